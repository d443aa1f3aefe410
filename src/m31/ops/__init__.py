"""Hot operations, each a public dispatcher over implementations of one stem (DESIGN §5)."""

from m31.ops.score_topk import NO_ROW, score_topk
from m31.ops.torch_score import gate_weights, score

__all__ = ["NO_ROW", "gate_weights", "score", "score_topk"]
