"""Where the Triton kernel's threshold τ sits (steps 1 and 4 of `m31.ops.triton.score_topk`).

Shapes: B requests, N ads, S sampled ads, U distinct bitmaps of a `PackedMask`.

A fixed-seed uniform sample of the table (`SAMPLE_ROWS` ads, not a strided one, which aliases
with periodic eligibility such as "every other ad") is scored with the fp32 reference. τ[r] is
the j-th best eligible sample score, j chosen so that about `_TARGET_PER_K`·K ads of the table
pass, and j ≥ `_MIN_SAMPLE_RANK` so that the survivor count is a stable estimate. A τ that let
fewer than K through moves to a sample rank `_LOWER_FACTOR` times deeper, at last -inf.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from m31.ops.masks import PackedMask
from m31.ops.reference.score import score

SAMPLE_ROWS = 32_768  # ads scored by the reference to seed τ
_TARGET_PER_K = 3  # survivors aimed at: about 3·K of the table (DESIGN §5 suggests 2–4)
# τ never sits above the 32nd best sample score: the survivor count then has a relative spread
# of about 1/√32 ≈ 18%, so a buffer of twice the estimate overflows about once in 10^6 requests.
_MIN_SAMPLE_RANK = 32
_CAPACITY_FACTOR = 2
_LOWER_FACTOR = 8  # a τ that let fewer than K through moves to an 8× deeper sample rank
_SAMPLE_CHUNK = 1 << 24  # elements of one [B, S, E] reference intermediate while seeding


class Seed(NamedTuple):
    """What the sample says about each request, to place and later lower τ."""

    sample: torch.Tensor  # [B, S] eligible sample scores, descending, -inf after the eligible
    n_sample: torch.Tensor  # [B] eligible ads in the sample
    n_eligible: torch.Tensor  # [B] eligible ads in the table


def seed(q, v, p, fp32_rows, n_ads, mask, sample_rows) -> Seed:
    """Score a fixed-seed uniform sample of the table with the fp32 reference.

    fp32_rows(idx) -> (g, x, b + value) fp32 of the ads idx; mask: None, bool [N] or [B, N], or
    a `PackedMask`."""
    n_req, n_exp = p.shape
    idx = _sample_ads(n_ads, sample_rows, q.device)  # [S]
    g_s, x_s, b_s = fp32_rows(idx)
    step = max(1, _SAMPLE_CHUNK // (len(idx) * n_exp))
    sample = []
    for lo in range(0, n_req, step):
        s = score(q[lo : lo + step], v[lo : lo + step], p[lo : lo + step], g_s, x_s, b_s)
        dropped = s.isnan() | _ineligible(mask, idx, lo, lo + step)  # [b, S]
        s = s.masked_fill(dropped, float("-inf"))
        sample.append(torch.sort(s, dim=1, descending=True).values)
    sample = torch.cat(sample)  # [B, S]
    n_sample = (sample > float("-inf")).sum(1)
    return Seed(sample, n_sample, _eligible_counts(mask, n_req, n_ads, q.device))


def _sample_ads(n_ads: int, sample_rows: int, device: torch.device) -> torch.Tensor:
    """The sampled rows, ascending: all of them in a table of at most `sample_rows` ads."""
    if n_ads <= sample_rows:
        return torch.arange(n_ads, device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    return torch.randint(n_ads, (sample_rows,), generator=gen, device=device).sort().values


def _ineligible(mask, idx: torch.Tensor, lo: int, hi: int) -> torch.Tensor | bool:
    """bool [b, S]: which sampled ads requests lo:hi may not take (a NaN score, never returned
    by `score_topk`, is dropped beside them, so it is never a threshold)."""
    if mask is None:
        return False
    if isinstance(mask, PackedMask):  # the sample's bits, of each distinct bitmap once
        held = (mask.bits[:, idx // 8] >> (idx % 8).to(torch.uint8)) & 1  # [U, S]
        return held.index_select(0, mask.index[lo:hi]) == 0
    return ~(mask[idx] if mask.dim() == 1 else mask[lo:hi, idx])


def _eligible_counts(mask, n_req: int, n_ads: int, device: torch.device) -> torch.Tensor:
    """[B]: the eligible ads of each request in the whole table."""
    if mask is None:
        return torch.full((n_req,), n_ads, device=device)
    if isinstance(mask, PackedMask):
        return mask.counts()
    return mask.sum(-1).expand(n_req)


def first_rank(seed: Seed, k_out: int) -> torch.Tensor:
    """[B] the sample rank τ sits at first: about `_TARGET_PER_K`·k_out ads of the table pass."""
    rank = (_TARGET_PER_K * k_out * seed.n_sample / seed.n_eligible.clamp(min=1)).ceil().long()
    return rank.clamp(min=_MIN_SAMPLE_RANK)


def threshold_at(seed: Seed, rank: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(τ [B], estimated survivors [B]) at the given sample rank (1 = the best sample score)."""
    placed = rank <= seed.n_sample
    at = (rank.clamp(max=seed.sample.shape[1]) - 1).clamp(min=0)
    tau = torch.where(placed, seed.sample.gather(1, at[:, None])[:, 0], float("-inf"))
    estimate = rank * seed.n_eligible / seed.n_sample.clamp(min=1)
    return tau, torch.where(placed, estimate, seed.n_eligible.float())


def capacity(estimate: torch.Tensor, n_eligible: torch.Tensor) -> int:
    """Candidate slots per request: twice the largest estimate, never more than can survive."""
    cap = torch.minimum((_CAPACITY_FACTOR * estimate).ceil(), n_eligible.float())
    return max(1, int(cap.max()))


def go_deeper(seed: Seed, rank, threshold, which: torch.Tensor) -> torch.Tensor:
    """Move requests `which` (τ too high) to a sample rank `_LOWER_FACTOR` times deeper, in place
    in rank [B] and threshold [B] (τ never rises; -inf once past the sample); the candidate slots
    they are expected to need, [len(which)]."""
    rank[which] *= _LOWER_FACTOR
    deeper, estimate = threshold_at(seed, rank)
    threshold[which] = torch.minimum(deeper[which], threshold[which])
    return torch.minimum(_CAPACITY_FACTOR * estimate[which], seed.n_eligible[which].float())
