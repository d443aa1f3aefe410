"""The cpu kernel: exhaustive score·gate·filter·top-K on CPU with proven bounds and exact rescoring.

Shapes: B requests, N ads, E experts, G gate-key dim, D value dim, K results, n ads per block,
S (request, ad) pairs that survive a filter.

Same contract as `torch_score_topk` (DESIGN §2): (scores [B, K'] fp32, rows [B, K'] int64) with
K' = min(k, N), best first, ties to the lower row; a request with fewer eligible ads ends in rows
NO_ROW and scores -inf. The returned scores are the reference's own (`rounded_score`: the §2
formula in fp64, rounded to fp32 once), so they depend on an ad's row alone.

The table is streamed once, in blocks of n ads that worker threads take in turn (torch on one
core each; the products release the GIL): 1. an affinity filter (one bf16 product per block, or
an exact int8 one for an 8-bit table, gives an upper bound U on every pair's score), 2. the gate
for the survivors only (bounds ℓ ≤ s ≤ h), 3. a threshold top-K shared by the workers (τ_r, the
K-th largest ℓ), 4. an exact finish (the last candidates rescored with `rounded_score`, an exact
stable top-K). Why this is exact, the bounds, the 8-bit path and where the time goes: DESIGN §5,
"The cpu kernel and why it is exact".

Requests with at most K' eligible ads skip the filters (step 4 alone); inputs whose logits or
scores could pass 2¹⁰⁰, or a table holding NaN or ±inf, go to the reference (`stats.in_range`).

Modules, in the order of a call:
* `score_topk`  — the entry points and the driver (checks, the block size, which path);
* `stats`       — the table's norms, cached per table, and the range check;
* `bounds`      — the per-call `Plan` (the rounded query, the bounds' coefficients), the bounds;
* `int8`        — an 8-bit table's query in integers, exact int8 products;
* `partition`   — spans of ads and the worker threads that take them;
* `worker`      — steps 1-3 in torch ops (`Worker`, the shared `Threshold`);
* `native_pass` — steps 1-3 of an 8-bit table in compiled code (`m31_pass`);
* `native`      — builds `csrc/` (the compiled steps, in C) on first use and loads it;
* `finish`      — step 4, and the requests with few eligible ads.
"""

from m31.ops.cpu.score_topk import cpu_score_topk, cpu_score_topk_int8

__all__ = ["cpu_score_topk", "cpu_score_topk_int8"]
