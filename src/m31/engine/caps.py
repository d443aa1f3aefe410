"""Caps per group in the top-K: at most `max` ads of one advertiser (or campaign) among a
request's results, so that ranking and the auction see several bidders (DESIGN §2, "Caps per
group").

The answer is defined by the plain walk (`reference`): go through the eligible ads in the
global order (score descending, then ad id ascending) and skip an ad whose group already has
`max` results, until K. An ad without a value in the group's field is its own group (never
skipped). Since whether an ad is skipped depends only on the ads of its own group before it,
the walk keeps exactly the first `max` ads of each group, and the answer is the first K of
those in the global order (`capped`, vectorised).

The engine fetches a prefix of the global order from the kernel (the top `want` rows, `want`
doubled while needed; `m31.engine.search.search`): the walk over a prefix is the walk over
every ad as long as the prefix ends after its K-th kept ad, or holds every eligible ad; the
last fetched score is excluded from the prefix unless all came, since ads tied with it may lie
beyond (the kernel breaks ties by row, the walk by ad id).

On a cluster each shard answers its own capped top-K and the merge walks their union again
(`merge`). That is exact: take an ad a of the global answer, on shard s. The ads s keeps before
a are those the global walk keeps too, and those it skips; it skips one of group g only when g
already has `max` ads kept before it, and s keeps at most `max` of g, so s keeps no more such
ads of g than g has kept on the other shards before a. In all, s keeps before a at most as many
ads as the global answer holds before a, fewer than K: a is in s's capped top-K.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

# What a request may cap (`"max_per": {"advertiser": 2}`) and the ads' field that holds it.
GROUP_FIELDS = {"advertiser": "advertiser_id", "campaign": "campaign_id"}


def capped(
    ad_ids: np.ndarray, scores: np.ndarray, groups: np.ndarray, valid: np.ndarray, cap: int, k: int
) -> np.ndarray:
    """Positions of the capped top-`k` of candidates [n] (ad ids, scores, each one's group and
    whether it has one), best first: the first `cap` of each group, then the first `k` of
    those in the global order."""
    order = np.lexsort((ad_ids, -scores))
    grouped = np.flatnonzero(valid[order])  # positions in the order of ads with a group
    g = groups[order][grouped]
    # Rank of each within its group, in the global order: sort by group (stable), subtract the
    # position where its group starts.
    by_group = np.argsort(g, kind="stable")
    at = np.arange(len(g))
    starts = np.r_[True, g[by_group][1:] != g[by_group][:-1]] if len(g) else at.astype(bool)
    rank = np.empty(len(g), np.int64)
    rank[by_group] = at - np.maximum.accumulate(np.where(starts, at, 0))
    keep = np.ones(len(order), bool)
    keep[grouped] = rank < cap
    return order[keep][:k]


def reference(
    ad_ids: np.ndarray, scores: np.ndarray, groups: np.ndarray, valid: np.ndarray, cap: int, k: int
) -> np.ndarray:
    """`capped` as the plain walk: one ad at a time, counting each group's results."""
    order = sorted(range(len(ad_ids)), key=lambda i: (-float(scores[i]), int(ad_ids[i])))
    taken: dict[int, int] = {}
    out = []
    for i in order:
        if len(out) == k:
            break
        if valid[i]:
            group = int(groups[i])
            if taken.get(group, 0) >= cap:
                continue
            taken[group] = taken.get(group, 0) + 1
        out.append(i)
    return np.array(out, dtype=np.int64)


def group_cap(max_per: Mapping[str, int] | None) -> tuple[str, int] | None:
    """(the ads' field, max) of a request's checked `max_per`, None without one."""
    if not max_per:
        return None
    ((name, cap),) = max_per.items()
    return GROUP_FIELDS[name], int(cap)
