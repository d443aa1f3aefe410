"""The Triton kernel: the fused score·gate·filter·top-K pass on the GPU (on CPU only under
`TRITON_INTERPRET=1`), exact top-K by a threshold and a candidate buffer (DESIGN §5).

Modules, in the order of a call:
* `score_topk` — the entry points and the scan-check loop (steps 1-4, ties, retries);
* `threshold`  — where τ sits: a sample of the table scored by the reference;
* `layout`     — the query in bf16 parts, the table's rows, the mask as int32 words;
* `launch`     — the tile shape by batch size, one launch of the kernel;
* `kernel`     — the @triton.jit bodies: scores, the gate, the mask, the candidate append.
"""

from m31.ops.triton.score_topk import triton_score_topk, triton_score_topk_int8

__all__ = ["triton_score_topk", "triton_score_topk_int8"]
