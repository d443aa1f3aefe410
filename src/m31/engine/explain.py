"""Why a request got its ads, and why not others: what a request asks with
`AdRequest(explain=True)` and `AdRequest(why_not=[ad ids])`, on its `Retrieved.explanation`.

Shapes: N rows of a view, E expert slots, G gate-key dim, D value dim.

An `Explanation` of one request holds:

* `eligible`: the ads left after each stage of eligibility (`m31.index.stages.STAGES`: live,
  status, schedule, age, each targeting list, exclusions, filter), in order, so that the stage
  that removed most of the corpus shows at once;
* `kth_score`: the score of the last ad returned (what another ad had to beat);
* per returned ad, its score split as DESIGN §2 computes it: the gate's weight of each expert
  slot for this ad, each slot's contribution w_e·<v_e, x_a>, the ad's bias b_a and, ranked by
  value, its value term; they add up to the score;
* per ad asked about (`why_not`), the first thing that kept it out: not in the index (unknown or
  deleted), the stage it failed with the ad's value and the request's, the request's cap per
  group, or, when eligible, its rank among the eligible ads and its score.

Everything here is the plain form: stage masks from the attribute columns, scores in fp64 from
the stored table (`m31.ops.reference`), computed only for the requests that ask. The ranks of
`why_not` order the eligible ads as the kernels do (the score rounded to fp32 once, ties to the
lower ad id), so without a cap the ad returned at position r has rank r.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from m31.engine.search import Retrieved
from m31.index import CompiledFilter, IndexView, RequestContext
from m31.index.filters import Clause, HasValue, NoneOf, evaluate_row
from m31.index.stages import STAGES, stage_masks
from m31.ops.reference import rounded_score, value_bias

# Ads one call may ask about per request: each costs a lookup, and the eligible ads are scored
# once per request that asks about any eligible ad.
MAX_WHY_NOT = 100


@dataclass(frozen=True)
class AdExplanation:
    ad_id: int
    score: float
    gate: list[float]  # [E] the gate's weight of each expert slot for this ad
    contributions: list[float]  # [E] w_e * <v_e, x_a>
    bias: float  # b_a
    value: float | None = None  # the value term, when the request ranks by value


@dataclass(frozen=True)
class WhyNot:
    ad_id: int
    # "unknown", one of `STAGES` (the first it failed), "cap", "rank" (eligible, ranked below
    # the K-th), "missed" (an approximate search did not score it) or "returned"
    stage: str
    reason: str
    score: float | None = None  # eligible: its score, and its rank among the eligible (1-based)
    rank: int | None = None


@dataclass(frozen=True)
class Explanation:
    eligible: dict[str, int]  # stage -> ads left after it, `STAGES` order
    kth_score: float | None
    experts: list[str]  # the expert slots' names, E
    ads: list[AdExplanation]
    why_not: list[WhyNot] = field(default_factory=list)


def slot_names(experts: dict[str, int]) -> list[str]:
    """The names of a model's expert slots in their order: the family, with its slot index
    where it has several (``sequence``, ``semantic.0``, ``semantic.1``)."""
    names = []
    for family, k in experts.items():
        names += [family] if k == 1 else [f"{family}.{i}" for i in range(k)]
    return names


@dataclass(frozen=True)
class Part:
    """One index's share of a request's explanation, which `finish` merges with the others': a
    sharded index's shard has one, a single index the whole of it (`explain_part`)."""

    eligible: dict[str, int]  # stage -> its ads left after it
    ads: list[AdExplanation]  # the split of each ad it returned (none without `split`)
    refused: dict[int, WhyNot]  # asked ads it holds that failed a stage -> why
    scores: dict[int, float]  # asked ads it holds that are eligible -> their score


def explain(
    view: IndexView,
    context: RequestContext,
    filter_fn: CompiledFilter | None,
    experts: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    scored: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    found: Retrieved,
    k: int,
    cap: tuple[str, int] | None,
    valued: bool,
    names: list[str],
    why_not: Sequence[int] = (),
    own_filter: Mapping | None = None,
    clauses: Sequence[Clause] = (),
    split: bool = True,
) -> Explanation:
    """One request's `Explanation` on one index: `explain_part`, `ranked_before` and `finish`
    with a single part. `experts`: its query per expert slot (q [E, G], v [E, D], p [E], the
    context folded into v); `scored`: the query the pass scored (the same, or folded to one
    slot); `found`: what the pass returned for it at `k` with the request's `cap` per group and
    ranking by value or not. `own_filter` (the request's JSON filter) and `clauses` (what the
    engine added to it) tell a why-not which of them removed an ad; without `split`, the results
    are not split (a request that asked only why not)."""
    masks = stage_masks(view, context, filter_fn)
    value = view.value_term() if valued else None
    part = _part(view, masks, experts, scored, found, value, why_not, own_filter, clauses, split)
    pairs = list(part.scores.items())
    before = _before(view, masks[STAGES[-1]], scored, value, pairs) if pairs else []
    counts = {a: n for (a, _), n in zip(pairs, before, strict=True)}
    return finish([part], counts, found, k, cap, names, why_not)


def explain_part(
    view: IndexView,
    context: RequestContext,
    filter_fn: CompiledFilter | None,
    experts: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    scored: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    found: Retrieved,
    valued: bool,
    why_not: Sequence[int] = (),
    own_filter: Mapping | None = None,
    clauses: Sequence[Clause] = (),
    split: bool = True,
) -> Part:
    """This index's `Part` of a request's explanation (`explain`'s arguments; `found`: what
    this index returned for it)."""
    masks = stage_masks(view, context, filter_fn)
    value = view.value_term() if valued else None
    return _part(view, masks, experts, scored, found, value, why_not, own_filter, clauses, split)


def ranked_before(
    view: IndexView,
    context: RequestContext,
    filter_fn: CompiledFilter | None,
    scored: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    valued: bool,
    pairs: Sequence[tuple[int, float]],
) -> list[int]:
    """For each (ad id, score) of `pairs`, how many of this index's eligible ads rank before it
    in the kernels' order (the score rounded to fp32 once, ties to the lower ad id): summed over
    every part, one less than its rank."""
    eligible = stage_masks(view, context, filter_fn)[STAGES[-1]]
    value = view.value_term() if valued else None
    return _before(view, eligible, scored, value, pairs)


def finish(
    parts: Sequence[Part],
    before: Mapping[int, int],
    found: Retrieved,
    k: int,
    cap: tuple[str, int] | None,
    names: list[str],
    why_not: Sequence[int] = (),
) -> Explanation:
    """The `Explanation` of a request from its parts, `before` (each eligible asked ad -> the
    eligible ads ranked before it, over every part: `ranked_before`) and the answer `found`
    merged from the parts' answers."""
    eligible = {s: sum(p.eligible[s] for p in parts) for s in STAGES}
    splits = {a.ad_id: a for p in parts for a in p.ads}
    ads = [splits[a] for a in found.ad_ids.tolist() if a in splits]
    kth = float(found.scores[-1]) if len(found.scores) else None
    returned = list(zip(found.ad_ids.tolist(), found.scores.tolist(), strict=True))
    n = eligible[STAGES[-1]]
    out = []
    for ad_id in (int(a) for a in why_not):
        refused = next((p.refused[ad_id] for p in parts if ad_id in p.refused), None)
        score = next((p.scores[ad_id] for p in parts if ad_id in p.scores), None)
        if refused is not None:
            out.append(refused)
        elif score is None:
            why = f"ad {ad_id} is not in the index (unknown or deleted)"
            out.append(WhyNot(ad_id, "unknown", why))
        else:
            out.append(_eligible(ad_id, score, before[ad_id] + 1, n, returned, k, cap, kth))
    return Explanation(eligible, kth, names, ads, out)


def _eligible(ad_id, score, rank, n, returned, k, cap, kth) -> WhyNot:
    """Why an eligible ad of that `rank` (of `n`) is, or is not, among the `returned` ones."""
    ids = [a for a, _ in returned]
    if ad_id in ids:
        return WhyNot(
            ad_id, "returned", f"returned at position {ids.index(ad_id) + 1}", score, rank
        )
    # The answer walks the eligible ads in rank order (`m31.engine.caps`): an ad it did not
    # return was either past its end (K taken before it) or skipped, its group full.
    above = sum(s > score or (s == score and a < ad_id) for a, s in returned)
    if cap is None and above < k:  # an exact pass would have returned it
        why = (
            f"eligible, rank {rank} of {n}, within the top {k}, but the search did not score it "
            "(an approximate search: the hierarchical index's probe passed over its cluster)"
        )
        return WhyNot(ad_id, "missed", why, score, rank)
    if cap is not None and above < k:
        name, most = cap
        why = (
            f"eligible, rank {rank} of {n}, but the request takes at most {most} ads of one "
            f"{name} and {most} of its {name} ranked above it"
        )
        return WhyNot(ad_id, "cap", why, score, rank)
    shown = "none" if kth is None else f"{kth:.6g}"
    why = f"eligible, rank {rank} of {n}: its score {score:.6g} is below the K-th's {shown}"
    return WhyNot(ad_id, "rank", why, score, rank)


def _part(view, masks, experts, scored, found, value, why_not, own_filter, clauses, split) -> Part:
    rows = _live_rows(view, [*found.ad_ids.tolist(), *why_not])
    refusal = _Refusal(view, own_filter, clauses)
    refused, eligible = {}, []
    for ad_id in (int(a) for a in why_not):
        row = rows.get(ad_id)
        if row is None:
            continue  # not held here
        failed = next((s for s in STAGES[1:] if not masks[s][row]), None)
        if failed is not None:
            refused[ad_id] = WhyNot(ad_id, failed, refusal(row, failed))
        else:
            eligible.append(ad_id)
    scores = {}
    if eligible:
        at = torch.tensor([rows[a] for a in eligible], dtype=torch.long)
        scores = dict(zip(eligible, _scores(view, at, scored, value).tolist(), strict=True))
    return Part(
        eligible={s: int(masks[s].sum()) for s in STAGES},
        ads=_split(view, rows, experts, value, found) if split else [],
        refused=refused,
        scores=scores,
    )


def _live_rows(view: IndexView, ad_ids: Sequence[int]) -> dict[int, int]:
    """ad id -> its live row in `view`, for those of `ad_ids` the view holds."""
    rows = view.rows_of(ad_ids)
    return {int(a): int(r) for a, r in zip(ad_ids, rows.tolist(), strict=True) if r >= 0}


def _table(view: IndexView, rows: torch.Tensor | slice):
    """(g, x, b) of `rows` in fp64 as the pass scores them (an 8-bit table dequantized)."""
    if view.scales is None:
        g, x, b = view.g[rows], view.x[rows], view.b[rows]
    else:
        g, x, b = view.ad_table.dequantize(rows)
    return g.double(), x.double(), b.double()


def _scores(view, at: torch.Tensor, scored, value) -> np.ndarray:
    """The scores of rows `at` as the kernels rank them: the §2 score (with the value term,
    added to the bias in fp32 as every kernel adds it) in fp64, rounded to fp32 once."""
    g, x, b = _table(view, at)
    b = value_bias(b.float(), None if value is None else value[at]).double()
    q, v, p = (t[None].double() for t in scored)
    return rounded_score(q, v, p, g, x, b)[0].numpy()


def _before(view, eligible, scored, value, pairs) -> list[int]:
    """`ranked_before` on a computed eligibility mask."""
    at = torch.nonzero(eligible).flatten()
    scores, ids = _scores(view, at, scored, value), view.row_ids[at].numpy()
    return [
        int(np.count_nonzero((scores > s) | ((scores == np.float32(s)) & (ids < a))))
        for a, s in pairs
    ]


def _split(view, rows: dict[int, int], experts, value, found: Retrieved) -> list[AdExplanation]:
    """The §2 score of each returned ad, term by term, in fp64 (all of them in one pass)."""
    ids = found.ad_ids.tolist()
    at = torch.tensor([rows[a] for a in ids], dtype=torch.long)
    q, v, p = (t.double() for t in experts)  # [E, G], [E, D], [E]
    g, x, b = _table(view, at)  # [K, G], [K, D], [K]
    logit = p[None].expand(len(ids), -1)
    if q.shape[-1]:
        logit = logit + g @ q.T / math.sqrt(q.shape[-1])  # [K, E]
    w = torch.softmax(logit, dim=1)
    parts = w * (x @ v.T)  # [K, E]
    values = [None] * len(ids) if value is None else value[at].tolist()
    return [
        AdExplanation(a, s, [round(t, 6) for t in wi], pi, bi, vi)
        for a, s, wi, pi, bi, vi in zip(
            ids,
            found.scores.tolist(),
            w.tolist(),
            parts.tolist(),
            b.tolist(),
            values,
            strict=True,
        )
    ]


@dataclass(frozen=True)
class _Refusal:
    """Why the ad at a row fails a stage, with its values (`__call__`)."""

    view: IndexView
    own_filter: Mapping | None
    clauses: Sequence[Clause]

    def __call__(self, row: int, stage: str) -> str:
        one = self.view.attributes.to_arrow(torch.tensor([row])).to_pylist()[0]
        if stage == "status":
            return f"its status is {one.get('status')!r}, not 'active'"
        if stage == "schedule":
            start, end = one.get("schedule_start"), one.get("schedule_end")
            return f"outside its schedule at the request's second (start {start}, end {end})"
        if stage == "age":
            lo, hi = one.get("target_age_min"), one.get("target_age_max")
            return (
                f"it targets ages {lo} to {hi} (None: open), and the user's age is not in them "
                "(an unknown age passes open ranges only)"
            )
        if stage == "excluded":
            return (
                "the request excludes it or its advertiser (exclude_ads, exclude_advertisers, "
                "or the request's frequency cap)"
            )
        if stage == "filter":
            return self._filtered(one)
        values = sorted(one.get(f"target_{stage}") or [])
        return f"it targets {stage} {values}, and the request's is not among them"

    def _filtered(self, one: dict) -> str:
        if self.own_filter is not None and not evaluate_row(self.own_filter, one):
            clause = _failing_clause(self.own_filter, one)
            fields = _fields(clause)
            values = ", ".join(f"{f}={one.get(f)!r}" for f in fields) or _shown(one)
            return f"the request's filter clause {json.dumps(clause)} removes it (its {values})"
        for clause in self.clauses:
            if isinstance(clause, HasValue) and one.get(clause.field) is None:
                return f"it has no {clause.field}, which ranking by value needs"
            if isinstance(clause, NoneOf) and one.get(clause.field) in clause.values:
                return (
                    f"the request's frequency cap leaves out its {clause.field} "
                    f"{one.get(clause.field)!r}"
                )
        return "the request's filter removes it"


def _failing_clause(expr: Mapping, attributes: dict) -> Mapping:
    """The part of a filter an ad fails: of an `all`, its first child the ad fails (looked
    into again); any other tree, itself."""
    while "all" in expr:
        expr = next(c for c in expr["all"] if not evaluate_row(c, attributes))
    return expr


def _fields(expr) -> list[str]:
    """The attribute fields a filter tree reads, in order, once each."""
    out: list[str] = []

    def walk(node) -> None:
        ((op, args),) = node.items()
        if op in ("all", "any"):
            for child in args:
                walk(child)
        elif op == "not":
            walk(args)
        elif args[0] not in out:
            out.append(args[0])

    walk(expr)
    return out


def _shown(attributes: dict) -> str:
    """An ad's non-null attributes, for a message."""
    return ", ".join(f"{k}={v!r}" for k, v in attributes.items() if v not in (None, []))
