"""Hot operations, each a public dispatcher over implementations of one stem (DESIGN §5)."""

from m31.ops.quant import Int8Table, quantize_ad_table
from m31.ops.score_topk import KERNELS, NO_ROW, available_kernels, score_topk
from m31.ops.torch_score import gate_weights, score

__all__ = [
    "KERNELS",
    "NO_ROW",
    "Int8Table",
    "available_kernels",
    "gate_weights",
    "quantize_ad_table",
    "score",
    "score_topk",
]
