"""Models: the retrieval mixture of experts, the two-tower baseline, the dense interaction
model, the ranking model, their checkpoints and the inference API (training is `m31.training`)."""

from m31.model.checkpoint import (
    build_model,
    checkpoint_hash,
    load_checkpoint,
    save_checkpoint,
    vocab_sizes,
)
from m31.model.config import PRESETS, ModelConfig, model_preset
from m31.model.dense import DenseModel
from m31.model.inference import ScoreFunction, encode_ads, encode_requests
from m31.model.inputs import Catalog, RequestInputs, make_requests
from m31.model.ranking import RankingModel
from m31.model.retrieval import RetrievalModel

__all__ = [
    "PRESETS",
    "Catalog",
    "DenseModel",
    "ModelConfig",
    "RankingModel",
    "RequestInputs",
    "RetrievalModel",
    "ScoreFunction",
    "build_model",
    "checkpoint_hash",
    "encode_ads",
    "encode_requests",
    "load_checkpoint",
    "make_requests",
    "model_preset",
    "save_checkpoint",
    "vocab_sizes",
]
