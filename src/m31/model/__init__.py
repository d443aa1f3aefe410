"""Models: the retrieval mixture of experts, the two-tower baseline, the ranking model."""

from m31.model.config import PRESETS, ModelConfig, model_preset
from m31.model.inputs import Catalog, Requests, make_requests
from m31.model.ranking import RankingModel
from m31.model.retrieval import RetrievalModel

__all__ = [
    "PRESETS",
    "Catalog",
    "ModelConfig",
    "RankingModel",
    "Requests",
    "RetrievalModel",
    "make_requests",
    "model_preset",
]
