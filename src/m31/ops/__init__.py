"""Hot operations, each a public dispatcher over implementations of one stem (DESIGN §5)."""

from m31.ops.masks import PackedMask
from m31.ops.quant import Int8Table, quantize_ad_table
from m31.ops.score_topk import (
    KERNELS,
    NO_ROW,
    NonFiniteQueryError,
    available_kernels,
    score_topk,
)
from m31.ops.torch_score import rounded_score, score

__all__ = [
    "KERNELS",
    "NO_ROW",
    "Int8Table",
    "NonFiniteQueryError",
    "PackedMask",
    "available_kernels",
    "quantize_ad_table",
    "rounded_score",
    "score",
    "score_topk",
]
