"""The reference implementation, in plain PyTorch: the definition of correct (DESIGN §5).

* `score`       — `score`, the §2 formula in fp32 (the model's forward), `rounded_score`, the same
  formula in fp64 rounded once (what the top-K kernels rank and return), and `value_bias`;
* `score_topk`  — `torch_score_topk`, the chunked exhaustive top-K that every kernel must match.
"""

from m31.ops.reference.score import rounded_score, score, value_bias
from m31.ops.reference.score_topk import torch_score_topk

__all__ = ["rounded_score", "score", "torch_score_topk", "value_bias"]
