"""Hot operations, each a public dispatcher over implementations grouped by backend (DESIGN §5).

* `score_topk` — the dispatcher: `score_topk(query, ad_table, mask, k, kernel="auto")`;
* `contract`   — what every implementation takes and returns (`check_args`, `NO_ROW`);
* `reference/` — plain PyTorch, the definition of correct (`score`, `torch_score_topk`);
* `cpu/`       — the cpu kernel: bounds, a shared threshold, an exact finish; its compiled
  steps in `cpu/csrc/`, built on first use by `cpu/native.py`;
* `triton/`    — the fused GPU kernel (on CPU only under `TRITON_INTERPRET=1`);
* shared by them: `masks` (eligibility bitmaps), `quant` (the 8-bit table), `threads` (small
  ops on one core), `testing` (`check_topk`, the comparison every kernel is held to).
"""

from m31.ops.contract import NO_ROW, NonFiniteQueryError
from m31.ops.masks import PackedMask
from m31.ops.quant import Int8Table, quantize_ad_table
from m31.ops.reference.score import rounded_score, score
from m31.ops.score_topk import KERNELS, available_kernels, score_topk

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
