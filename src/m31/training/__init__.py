"""Training: the models of `m31.model` fitted on a dataset's features (reads `m31.eval`).

train.py   the loop: epochs, validation, early stopping, resumable state
losses.py  each batch's loss (sampled or full softmax, SASRec's BCE, the pair models')
job.py     a training job from a dataset folder to a checkpoint file (`m31 train`)
recipe.py  what `m31 train` trains when no preset is named
"""

from m31.training.train import default_device, train

__all__ = ["default_device", "train"]
