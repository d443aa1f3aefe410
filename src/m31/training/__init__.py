"""Training: the models of `m31.model` fitted on a dataset's features (reads `m31.eval`)."""

from m31.training.train import default_device, train

__all__ = ["default_device", "train"]
