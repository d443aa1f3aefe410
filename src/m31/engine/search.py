"""Search: the exact top-K of each request over one view of the ad table, and the merge of
shards' answers by the same rule.

Shapes: B requests, N rows of the ad table, E experts, G gate-key dim, D value dim, K results.

`eligible_masks` evaluates each request's eligibility into a bitmask over the view's rows and
`search` runs the exhaustive score·filter·top-K pass over `m31.ops.score_topk`. A shard of a
cluster (`m31.cluster`) runs both on its own rows with the query the ingress encoded once, and
the ingress `merge`s the shards' answers.

The tie rule: equal scores go to the lower ad id, everywhere (one index, or any sharding of
it), so that the answer does not depend on where an ad's row sits. The kernels break ties by
the lower row; `search` asks them for `TIE_MARGIN` more results than it needs and, while the
last of those still ties with the K-th, for twice as many (up to every row), then orders the
candidates by (score descending, ad id ascending). That is exact: every ad scoring above the
kernel's last result is among its results.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from m31.engine.caps import capped
from m31.engine.requests import AdRequest
from m31.index import CompiledFilter, IndexView, RequestContext
from m31.ops import NO_ROW, PackedMask, score_topk

if TYPE_CHECKING:
    from m31.engine.explain import Explanation

# Extra results asked of the kernel beyond K, so that ties at the K-th score rarely need a retry.
TIE_MARGIN = 64


@dataclass
class Retrieved:
    ad_ids: np.ndarray  # [k'] int64, best first (k' <= k: fewer when fewer are eligible)
    scores: np.ndarray  # [k'] float32
    # With a cap per group: each ad's group value and whether it has one ([k'] int64, bool),
    # which a merge of shards' answers walks again (`m31.engine.caps`)
    groups: tuple[np.ndarray, np.ndarray] | None = None
    # For a request that asked (`AdRequest.explain`, `why_not`): `m31.engine.explain.Explanation`
    explanation: Explanation | None = None


@dataclass
class RetrievalResult:
    results: list[Retrieved]
    version: int  # index version every request of the batch saw
    # encode, mask, score_topk (and explain, when a request asked why)
    timings_ms: dict[str, float] = field(default_factory=dict)


def request_context(request: AdRequest, targeting: Mapping) -> RequestContext:
    """What `request` is eligible against: the user's `targeting` (country, age, gender; what
    `Retriever.prepare` resolved) in the request's serving context, with its exclusions."""
    return RequestContext(
        country=targeting.get("country"),
        age=targeting.get("age"),
        gender=targeting.get("gender"),
        platform=request.platform,
        surface=request.surface,
        ts=request.ts,
        exclude_ads=request.exclude_ads,
        exclude_advertisers=request.exclude_advertisers,
    )


def eligible_masks(
    view: IndexView, requests: Sequence[tuple[RequestContext, CompiledFilter | None]]
) -> PackedMask | None:
    """Each (context, compiled filter) evaluated over the view's rows, from the index's row
    bitmaps, as the kernels take it: one bitmap per distinct targeting (and per request with
    exclusions), N / 8 bytes each, never a [B, N] bool mask (`IndexView.eligible_bits`)."""
    if not requests:
        return None
    contexts, filters = zip(*requests, strict=True)
    return view.eligible_bits(contexts, filters)


def search(
    query: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    view: IndexView,
    mask: torch.Tensor | None,
    ks: Sequence[int],
    kernel: str = "auto",
    caps: Sequence[tuple[str, int] | None] | None = None,
    valued: Sequence[bool] | None = None,
) -> list[Retrieved]:
    """Each request's top `ks[r]` eligible ads of `view`, best first, ties to the lower ad id.

    query = (q [B, E, G], v [B, E, D], p [B, E]); mask: a `PackedMask` of B requests or bool
    [B, N] or None (every row). caps: per request, (the ads' field, max) of a cap per group
    (`m31.engine.caps`) or None. valued: per request, whether it ranks by the score plus the
    ads' value term (`IndexView.value_term`, read by the pass as one more column); a batch that
    mixes both kinds takes one pass per kind.
    """
    if valued is not None and any(valued) and not all(valued):
        return _by_kind(query, view, mask, ks, kernel, caps, valued)
    value = view.value_term() if valued is not None and any(valued) else None
    n = int(view.row_ids.shape[0])
    out: list[Retrieved | None] = [None] * len(ks)
    todo = np.arange(len(ks))
    want = min(max(ks, default=0) + TIE_MARGIN, n)
    empty = Retrieved(np.zeros(0, np.int64), np.zeros(0, np.float32))
    while len(todo):
        if want == 0:
            for r in todo:
                out[r] = empty
            break
        pick = torch.as_tensor(todo, device=view.row_ids.device)
        sub = tuple(t[pick] for t in query) if len(todo) < len(ks) else query
        sub_mask = _mask_of(mask, pick) if len(todo) < len(ks) else mask
        scores, rows = score_topk(sub, view.ad_table, sub_mask, want, kernel, value)  # [b, K']
        ids = torch.where(rows == NO_ROW, NO_ROW, view.row_ids[rows.clamp_min(0)])
        scores, ids, rows = scores.cpu().numpy(), ids.cpu().numpy(), rows.cpu().numpy()
        again = []
        for r, s, i, at in zip(todo.tolist(), scores, ids, rows, strict=True):
            found = i != NO_ROW
            s, i, k = s[found], i[found], ks[r]
            if caps and caps[r] is not None:
                got = _capped(view, caps[r], at[found], i, s, k, len(s) < want or want == n)
                if got is None:
                    again.append(r)
                else:
                    out[r] = got
                continue
            # Cut short by the kernel while still tied with the K-th: ads of that score (and a
            # lower id) may lie beyond; fewer than asked means every eligible ad came.
            if len(s) == want < n and len(s) >= k and s[k - 1] == s[-1]:
                again.append(r)
                continue
            order = np.lexsort((i, -s))[:k]  # score descending, then ad id ascending
            out[r] = Retrieved(ad_ids=i[order], scores=s[order])
        todo, want = np.array(again, dtype=np.int64), min(2 * want, n)
    return out  # type: ignore[return-value]


def _mask_of(mask, pick: torch.Tensor):
    """The masks of the requests `pick` of a batch's `PackedMask` or bool [B, N] (or None)."""
    if mask is None:
        return None
    return mask.select(pick) if isinstance(mask, PackedMask) else mask[pick]


def _by_kind(query, view: IndexView, mask, ks, kernel: str, caps, valued) -> list[Retrieved]:
    """`search` of a batch that mixes value-ranked requests with others: one pass per kind."""
    out: list[Retrieved | None] = [None] * len(ks)
    for kind in (False, True):
        idx = [r for r, v in enumerate(valued) if v == kind]
        pick = torch.as_tensor(idx, device=view.row_ids.device)
        sub_query = tuple(t[pick] for t in query)
        sub_caps = None if caps is None else [caps[r] for r in idx]
        sub_ks = [ks[r] for r in idx]
        found = search(
            sub_query, view, _mask_of(mask, pick), sub_ks, kernel, sub_caps, [kind] * len(idx)
        )
        for r, got in zip(idx, found, strict=True):
            out[r] = got
    return out  # type: ignore[return-value]


def _capped(view: IndexView, cap, rows, ids, scores, k: int, every: bool) -> Retrieved | None:
    """The capped top-k of a request's fetched rows (ids, scores), or None when they do not
    reach far enough: `every` eligible row came, or the walk kept k before the last fetched
    score (ads tied with it may lie beyond)."""
    field_, most = cap
    inside = np.ones(len(scores), bool) if every or not len(scores) else scores > scores.min()
    at = torch.as_tensor(rows[inside], device=view.row_ids.device)
    values, valid = (t[at].cpu().numpy() for t in view.attributes.numeric(field_))
    pick = capped(ids[inside], scores[inside], values, valid, most, k)
    if len(pick) < k and not every:
        return None
    return Retrieved(ids[inside][pick], scores[inside][pick], (values[pick], valid[pick]))


def merge(parts: Sequence[Retrieved], k: int, cap: tuple[str, int] | None = None) -> Retrieved:
    """The top `k` of several disjoint sets of ranked ads (shards), by the same rule as
    `search`: exact when each part holds its own top `k` (under the same `cap`, whose groups
    the parts carry: `m31.engine.caps`)."""
    ids = np.concatenate([p.ad_ids for p in parts]) if parts else np.zeros(0, np.int64)
    scores = np.concatenate([p.scores for p in parts]) if parts else np.zeros(0, np.float32)
    if cap is not None:
        values = np.concatenate([p.groups[0] for p in parts]) if parts else np.zeros(0, np.int64)
        valid = np.concatenate([p.groups[1] for p in parts]) if parts else np.zeros(0, bool)
        pick = capped(ids, scores, values, valid, cap[1], k)
        return Retrieved(ids[pick], scores[pick], (values[pick], valid[pick]))
    order = np.lexsort((ids, -scores))[:k]
    return Retrieved(ad_ids=ids[order], scores=scores[order])


def fold(
    q: torch.Tensor, v: torch.Tensor, p: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The query of a model without gate keys (G = 0) as one expert: every ad then gets the
    same expert weights softmax(p), so its score Σ_e w_e <v_e, x> + b is <Σ_e w_e v_e, x> + b,
    one dot product (2D + 1 FLOPs per pair instead of E of them plus a softmax). The folded
    value is computed in fp64 and rounded once, so scores agree with the unfolded query's up to
    fp32 rounding (answers up to near-ties). Other queries are returned as they are."""
    if q.shape[-1] != 0 or q.shape[1] == 1:
        return q, v, p
    w = torch.softmax(p.double(), dim=1)  # [B, E]
    folded = (w[:, :, None] * v.double()).sum(1, keepdim=True).to(v.dtype)  # [B, 1, D]
    return q[:, :1], folded, torch.zeros_like(p[:, :1])
