"""The baselines the kernels are timed against, each computing the problem it is timed on.

Shapes: B requests, N ads, E experts, G gate-key dim, D value dim, K results, C ads per chunk.

* eager     — the §2 formula as unfused PyTorch (bf16 products, fp32 gate) and `torch.topk`, over
              chunks of ads so that the [B, E, C] intermediates stay bounded at any N;
* compile   — the same chunk function under `torch.compile`;
* two-tower — the E = 1, G = 0 special case: a bf16 matmul and `torch.topk`;
* faiss     — FAISS `IndexFlatIP` on the CPU for the two-tower case (fp32, an ID bitmap for
              eligibility); needs the optional faiss package.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch

from m31.bench.common import Skip

# (request, ad) pairs per chunk of the eager and compiled baselines: [B, E, C] fp32 intermediates
# of about 1 GB on a GPU, 64 MB on a CPU (E = 8).
PAIRS_PER_CHUNK = {"cuda": 1 << 25, "cpu": 1 << 21}


def gate_scores(q2, v2, p, g, x, b, mask):
    """One chunk of §2 scores, unfused: q2 [B·E, G] (pre-scaled by 1/sqrt(G)) and v2 [B·E, D] in
    the table's dtype, p [B, E] fp32; g [C, G], x [C, D], b [C], mask [C] -> [B, C] fp32, -inf
    where ineligible. Products in the table's dtype (tensor cores), the gate in fp32."""
    n_req, n_exp = p.shape
    logit = (q2 @ g.T).float().view(n_req, n_exp, -1) + p[:, :, None]  # [B, E, C]
    w = torch.softmax(logit, dim=1)  # [B, E, C]
    affinity = (v2 @ x.T).float().view(n_req, n_exp, -1)  # [B, E, C]
    s = (w * affinity).sum(1) + b.float()  # [B, C]
    return s.masked_fill(~mask, float("-inf"))


@functools.cache
def compiled_gate_scores():
    # One compiled function for the whole process, so that each (B, C) compiles once.
    return torch.compile(gate_scores, dynamic=False)


def chunk_size(n: int, n_req: int, device: torch.device) -> int:
    """Ads per chunk for the eager and compiled baselines: about PAIRS_PER_CHUNK pairs; a divisor
    of N when one is within 2x, so that all chunks share one shape and compile once per B."""
    target = max(1, PAIRS_PER_CHUNK[device.type] // n_req)
    if target >= n:
        return n
    best = max(
        (d for i in range(1, math.isqrt(n) + 1) if n % i == 0 for d in (i, n // i) if d <= target),
        default=1,
    )
    return best if 2 * best >= target else target


def chunked_topk(chunk_scores, query, table, mask, k: int, chunk: int):
    """(scores [B, K'], rows [B, K']): each chunk's top K merged into a running top K."""
    q, v, p = query
    g, x, b = table
    n_req, n_exp, gdim = q.shape
    scale = gdim**-0.5 if gdim else 1.0
    q2 = (q * scale).reshape(n_req * n_exp, gdim).to(g.dtype)  # [B·E, G]
    v2 = v.reshape(n_req * n_exp, -1).to(x.dtype)  # [B·E, D]
    best_s = best_r = None
    for lo in range(0, g.shape[0], chunk):
        hi = min(lo + chunk, g.shape[0])
        s = chunk_scores(q2, v2, p, g[lo:hi], x[lo:hi], b[lo:hi], mask[lo:hi])  # [B, C]
        s, r = s.topk(min(k, hi - lo), dim=1)
        r = r + lo
        if best_s is not None:
            s, r = torch.cat([best_s, s], 1), torch.cat([best_r, r], 1)
            s, pick = s.topk(min(k, s.shape[1]), dim=1)
            r = r.gather(1, pick)
        best_s, best_r = s, r
    return best_s, best_r


def two_tower_topk(query, table, mask, k: int):
    """The E = 1, G = 0 model: the first expert's value as the user vector, u·x, top K."""
    x = table[1]
    u = query[1][:, 0, :].to(x.dtype)  # [B, D]
    s = (u @ x.T).float()  # [B, N]
    s.masked_fill_(~mask, float("-inf"))
    return s.topk(min(k, x.shape[0]), dim=1)


class FaissFlat:
    """FAISS exact inner-product search on the CPU over x (fp32); eligibility as an ID bitmap."""

    def __init__(self, x: torch.Tensor, mask: torch.Tensor):
        try:
            import faiss
        except ImportError:
            raise Skip("faiss is not installed") from None
        self.index = faiss.IndexFlatIP(x.shape[1])
        self.index.add(x.float().cpu().numpy())
        # FAISS keeps raw pointers to the bitmap and the selector: both live as long as self.
        self._bits = np.packbits(mask.cpu().numpy(), bitorder="little")
        self._selector = faiss.IDSelectorBitmap(self._bits)
        self.params = faiss.SearchParameters(sel=self._selector)

    def search(self, query, k: int):
        u = query[1][:, 0, :].float().cpu().numpy()  # [B, D]
        return self.index.search(u, k, params=self.params)
