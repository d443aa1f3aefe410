"""The definition of eligibility (DESIGN §4, "Eligibility") that the index's row bitmaps are
tested against, written out plainly twice: per ad on its plain attributes (`eligible`,
`eligible_ads`, and `refusing_stage`: the first stage of `m31.index.stages` an ad fails), and
over an index's attribute columns (`reference_mask`, the column builder the engine used before
the bitmaps, which `m31 bench eligibility` times against them).

    live & active & schedule(ts) & ages(age) & filter
         & AND over the targeting lists of (list empty | list holds the request's value)
         & not excluded (exclude_ads, exclude_advertisers)

Shapes: N rows of an index (tombstones included).

Both read only what every reader may: an ad's attributes, and the index's public reads (its
schema, a view's columns and row ids, its live rows).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from m31.index.attributes import AttributeTable
from m31.index.eligibility import RequestContext
from m31.index.filters import CompiledFilter, compile_filter, evaluate_row
from m31.index.reads import AdIndexReads

# Each targeting list and the field of the request it is matched against.
_TARGETED = (
    ("target_countries", "country"),
    ("target_genders", "gender"),
    ("target_platforms", "platform"),
    ("target_surfaces", "surface"),
)


def eligible(
    ad_id: int, attributes: Mapping[str, Any], request: RequestContext, expr: Mapping | None
) -> bool:
    """Whether one ad is eligible for `request` and the filter `expr` (a JSON tree, or None).

    `attributes`: the ad's, by field name, as `AdIndex.get` reads them back or as they were
    given (an absent field is null, and an absent or null status is active, as the index stores
    it); `evaluate_row` is the definition of the filter. A targeting list that is empty or null
    restricts nothing; an unknown (None) request value matches only such lists.
    """
    a = attributes

    def allows(targets: Sequence[str] | None, value: str | None) -> bool:
        return not targets or value in targets

    start, end = a.get("schedule_start"), a.get("schedule_end")
    lo, hi = a.get("target_age_min"), a.get("target_age_max")
    age = request.age
    return (
        (a.get("status") or "active") == "active"
        and (start is None or start <= request.ts)
        and (end is None or request.ts < end)
        and (lo is None or (age is not None and lo <= age))
        and (hi is None or (age is not None and age <= hi))
        and all(allows(a.get(name), getattr(request, asked)) for name, asked in _TARGETED)
        and ad_id not in request.exclude_ads
        and a.get("advertiser_id") not in request.exclude_advertisers
        and (expr is None or evaluate_row(expr, a))
    )


def refusing_stage(
    ad_id: int, attributes: Mapping[str, Any], request: RequestContext, expr: Mapping | None
) -> str | None:
    """The first stage of `m31.index.stages.STAGES` that one live ad fails for `request` and
    the filter `expr`, read as `eligible` reads it; None if it is eligible. ("live" is the
    index's: an ad given here exists.)"""
    a = attributes
    start, end = a.get("schedule_start"), a.get("schedule_end")
    lo, hi = a.get("target_age_min"), a.get("target_age_max")
    age = request.age
    if (a.get("status") or "active") != "active":
        return "status"
    if not ((start is None or start <= request.ts) and (end is None or request.ts < end)):
        return "schedule"
    if not (
        (lo is None or (age is not None and lo <= age))
        and (hi is None or (age is not None and age <= hi))
    ):
        return "age"
    for name, asked in _TARGETED:
        targets = a.get(name)
        if targets and getattr(request, asked) not in targets:
            return name.removeprefix("target_")
    if ad_id in request.exclude_ads or a.get("advertiser_id") in request.exclude_advertisers:
        return "excluded"
    if expr is not None and not evaluate_row(expr, a):
        return "filter"
    return None


def eligible_ads(
    ads: Mapping[int, Mapping[str, Any]], request: RequestContext, expr: Mapping | None
) -> set[int]:
    """The ids of the ads (ad id -> attributes, as `eligible` reads them) eligible for
    `request` and `expr`."""
    return {
        ad_id for ad_id, attributes in ads.items() if eligible(ad_id, attributes, request, expr)
    }


def reference_mask(
    index: AdIndexReads, request: RequestContext, filter_fn: CompiledFilter | Mapping | None
) -> torch.Tensor:
    """The eligibility mask [N] of `index` (an `AdIndex`, or a view's frozen copy of one) for
    `request` and `filter_fn` (compiled, or a JSON tree), from the attribute columns alone: the
    definition the bitmaps of `m31.index.eligibility` keep."""
    if isinstance(filter_fn, Mapping):
        filter_fn = compile_filter(filter_fn, index.schema)
    with index.snapshot_view() as view:
        attrs, row_ids = view.attributes, view.row_ids  # [N] each
        mask = index.live_mask()  # [N]
        active = attrs.code("status", "active")
        if active is None:
            return torch.zeros_like(mask)
        mask &= attrs.codes("status") == active
        mask &= _scheduled(attrs, int(request.ts))
        mask &= _ages(attrs, request.age)
        for name, asked in _TARGETED:
            mask &= ~attrs.nonempty(name) | attrs.contains(name, getattr(request, asked))
        mask &= ~_excluded(attrs, row_ids, request, index.device)
        if filter_fn is not None:
            mask &= filter_fn(attrs)
        return mask


def _scheduled(attrs: AttributeTable, ts: int) -> torch.Tensor:
    """[N] bool: rows whose schedule holds second `ts` (a null bound is open)."""
    start, has_start = attrs.numeric("schedule_start")
    end, has_end = attrs.numeric("schedule_end")
    return (~has_start | (start <= ts)) & (~has_end | (ts < end))


def _ages(attrs: AttributeTable, age: int | None) -> torch.Tensor:
    """[N] bool: rows whose age range admits `age` (None: unknown, which only open ranges do)."""
    lo, has_lo = attrs.numeric("target_age_min")
    hi, has_hi = attrs.numeric("target_age_max")
    if age is None:
        return ~has_lo & ~has_hi
    return (~has_lo | (lo <= int(age))) & (~has_hi | (int(age) <= hi))


def _excluded(
    attrs: AttributeTable, row_ids: torch.Tensor, request: RequestContext, device: torch.device
) -> torch.Tensor:
    """[N] bool: rows of the ads or advertisers the request excludes. Ads by id over the rows,
    not through an id -> row map: rows of other versions of an ad are not live anyway."""
    out = torch.zeros(len(row_ids), dtype=torch.bool, device=device)  # [N]
    if len(request.exclude_ads):
        excluded = torch.tensor(
            [int(a) for a in request.exclude_ads], dtype=torch.int64, device=device
        )
        out |= torch.isin(row_ids, excluded)
    if len(request.exclude_advertisers):
        blocked = torch.tensor(
            [int(a) for a in request.exclude_advertisers], dtype=torch.int64, device=device
        )
        advertiser, has_advertiser = attrs.numeric("advertiser_id")
        out |= has_advertiser & torch.isin(advertiser, blocked)
    return out
