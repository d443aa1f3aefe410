"""`check_topk`: is a score·top-K result an exact top K, up to float rounding? The one comparison
the tests and `m31 bench kernels --check` hold every implementation to.

Shapes: B requests, N ads, E experts, G gate-key dim, D value dim, K' = min(K, N) results.

An exact comparison of rows would fail a correct kernel wherever two scores are closer than the
kernel's rounding; comparing scores alone would pass a kernel that returns the wrong rows with
plausible scores. `check_topk` takes the scores position by position from the reference and
checks every returned row on its own: eligible, distinct, carrying its own score, best first.
"""

from __future__ import annotations

import torch

from m31.ops.contract import NO_ROW
from m31.ops.reference.score import score

# Both sides read the same bf16 (or dequantized 8-bit) table, the reference in fp32; a kernel may
# round the query to bf16 (about 2^-9 relative), and a real bug moves scores by O(1) at the unit
# scale of `m31.bench`'s random problem.
ATOL, RTOL = 2e-2, 2e-2


def check_topk(got, ref, query, table, mask, atol=ATOL, rtol=RTOL) -> str | None:
    """None if `got` is an exact top K of `table` up to float rounding, else what is wrong.

    got, ref: (scores [B, K'] fp32, rows [B, K'] int64), `ref` from the reference; query =
    (q [B, E, G], v [B, E, D], p [B, E]); table = (g [N, G], x [N, D], b [N]) as scored (an 8-bit
    table dequantized); mask: bool [N] or [B, N] or None. Rows may differ from the reference's
    only where scores tie within the tolerance: position by position the scores must match, and
    every returned row must be eligible, distinct, carry its own score and come best first; the
    NO_ROW tail must match exactly.
    """
    gs, gr = (t.cpu() for t in got)
    rs, rr = (t.cpu() for t in ref)
    if gs.shape != rs.shape or gr.shape != rr.shape:
        return f"shapes {tuple(gs.shape)}, {tuple(gr.shape)}; expected {tuple(rs.shape)}"
    if gr.dtype != torch.int64 or gs.dtype != torch.float32:
        return f"dtypes {gs.dtype}, {gr.dtype}; expected float32, int64"
    found = rr != NO_ROW  # [B, K']
    if not torch.equal(gr != NO_ROW, found):
        return "NO_ROW slots differ (a wrong count of eligible ads)"
    if not torch.isneginf(gs[~found]).all():
        return "scores of NO_ROW slots are not -inf"
    err = (gs[found] - rs[found]).abs()
    if (err > atol + rtol * rs[found].abs()).any():
        return f"scores differ from the reference by up to {float(err.max()):.3g}"
    q, v, p = (t.cpu() for t in query)
    g, x, b = (t.cpu() for t in table)
    for i in range(gr.shape[0]):
        rows, s = gr[i][found[i]], gs[i][found[i]]  # [K_i]
        if len(rows) == 0:
            continue
        if len(set(rows.tolist())) != len(rows):
            return f"request {i}: a row returned twice"
        if (rows < 0).any() or (rows >= g.shape[0]).any():
            return f"request {i}: row out of range"
        m = None if mask is None else (mask if mask.dim() == 1 else mask[i]).cpu()  # [N]
        if m is not None and not m[rows].all():
            return f"request {i}: an ineligible row returned"
        exact = score(q[i : i + 1], v[i : i + 1], p[i : i + 1], g[rows], x[rows], b[rows])[0]
        if ((exact - s).abs() > atol + rtol * exact.abs()).any():
            return f"request {i}: a returned score is not its row's score"
        if (s[1:] > s[:-1]).any():
            return f"request {i}: not best first"
    return None
