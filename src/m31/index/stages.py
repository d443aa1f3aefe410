"""Eligibility as named stages, for explaining an answer (`m31.engine.explain`): the ads left
after each stage of DESIGN §4's definition, applied in this order, over a view's attribute
columns:

    live        the row holds an ad that is not deleted
    status      status is active
    schedule    the request's second lies in the ad's schedule
    age         the ad's age range admits the user's age (an unknown age: open ranges only)
    countries, genders, platforms, surfaces
                the targeting list is empty, or holds the request's value
    excluded    not among the request's excluded ads or advertisers
    filter      the request's compiled filter (its own, and the clauses the engine adds)

Shapes: N rows of a view (tombstones included).

The last stage's mask is the eligibility mask the index's bitmaps keep (`IndexView.eligible_bits`,
tested equal); this is the plain column form, one pass over a column per stage, computed only
for a request that asks why.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from m31.index.eligibility import TARGETING, RequestContext
from m31.index.filters import CompiledFilter, compile_filter
from m31.index.reads import IndexView

# The stage of each targeting list, named as a user says it.
_TARGETING_STAGES = {name: name.removeprefix("target_") for name in TARGETING}
STAGES = (
    "live",
    "status",
    "schedule",
    "age",
    *_TARGETING_STAGES.values(),
    "excluded",
    "filter",
)


def stage_masks(
    view: IndexView, request: RequestContext, filter_fn: CompiledFilter | Mapping | None
) -> dict[str, torch.Tensor]:
    """Stage name -> bool [N]: the rows of `view` that pass that stage and every one before it
    (`STAGES` order); `filter_fn` compiled, a JSON tree, or None."""
    if isinstance(filter_fn, Mapping):
        filter_fn = compile_filter(filter_fn, view.schema)
    attrs = view.attributes
    out: dict[str, torch.Tensor] = {}
    mask = view.live_mask()

    def after(stage: str, passes: torch.Tensor) -> None:
        nonlocal mask
        mask = mask & passes
        out[stage] = mask

    out["live"] = mask
    active = attrs.code("status", "active")
    after("status", attrs.codes("status") == active if active is not None else mask & False)
    start, has_start = attrs.numeric("schedule_start")
    end, has_end = attrs.numeric("schedule_end")
    ts = int(request.ts)
    after("schedule", (~has_start | (start <= ts)) & (~has_end | (ts < end)))
    lo, has_lo = attrs.numeric("target_age_min")
    hi, has_hi = attrs.numeric("target_age_max")
    if request.age is None:
        after("age", ~has_lo & ~has_hi)
    else:
        age = int(request.age)
        after("age", (~has_lo | (lo <= age)) & (~has_hi | (age <= hi)))
    for name, stage in _TARGETING_STAGES.items():
        asked = getattr(request, TARGETING[name])
        after(stage, ~attrs.nonempty(name) | attrs.contains(name, asked))
    after("excluded", ~_excluded(view, request))
    after("filter", filter_fn(attrs) if filter_fn is not None else torch.ones_like(mask))
    return out


def _excluded(view: IndexView, request: RequestContext) -> torch.Tensor:
    """bool [N]: rows of the ads or advertisers the request excludes."""
    device = view.row_ids.device
    out = torch.zeros(len(view.row_ids), dtype=torch.bool, device=device)
    if len(request.exclude_ads):
        ads = torch.tensor([int(a) for a in request.exclude_ads], dtype=torch.int64, device=device)
        out |= torch.isin(view.row_ids, ads)
    if len(request.exclude_advertisers):
        blocked = [int(a) for a in request.exclude_advertisers]
        advertiser, has = view.attributes.numeric("advertiser_id")
        out |= has & torch.isin(advertiser, torch.tensor(blocked, device=device))
    return out
