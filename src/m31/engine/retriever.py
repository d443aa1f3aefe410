"""The retrieval engine: a trained retrieval model and an `AdIndex` -> ranked ads per request.

Shapes: B requests, N rows of the ad table, E experts, G gate-key dim, D value dim, K results.

`Retriever.prepare` checks requests once (`m31.engine.requests`); one call of
`Retriever.retrieve` encodes the batch's requests once (`Retriever.encode`: user experts,
context folded in; a user is either a stored user of the feature store or given inline),
evaluates each request's eligibility into a bitmask over the index's rows (`eligible_masks`),
and runs the exhaustive score·filter·top-K pass (`search`, over `m31.ops.score_topk`). Table and
masks come from one `frozen_view` of the index, so a batch is answered at one consistent
version, and mutations never wait for the masks or the pass. A shard of a cluster
(`m31.cluster`) runs `eligible_masks` and `search` on its own rows with the query the ingress
encoded once.

The tie rule: equal scores go to the lower ad id, everywhere (one index, or any sharding of
it), so that the answer does not depend on where an ad's row sits. The kernels break ties by
the lower row; `search` asks them for `TIE_MARGIN` more results than it needs and, while the
last of those still ties with the K-th, for twice as many (up to every row), then orders the
candidates by (score descending, ad id ascending). That is exact: every ad scoring above the
kernel's last result is among its results.
"""

from __future__ import annotations

import contextlib
import dataclasses
import numbers
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from m31.data.schema import N_AGE_BUCKETS, age_bucket
from m31.engine.caps import GROUP_FIELDS, capped, group_cap
from m31.engine.requests import (
    HAS_BID,
    RANKS,
    AdRequest,
    InlineUser,
    PreparedRequest,
    RequestError,
    one_of,
)
from m31.features import Features
from m31.index import AdIndex, CompiledFilter, IndexView, RequestContext, compile_filter
from m31.index.users import ATTRIBUTES as USER_ATTRIBUTES
from m31.index.users import Events, UserStore, Vocab
from m31.model import Catalog, RetrievalModel
from m31.model.inputs import concat_requests, inline_requests, request_inputs
from m31.ops import NO_ROW, PackedMask, score_topk
from m31.ops.threads import single_threaded

# Extra results asked of the kernel beyond K, so that ties at the K-th score rarely need a retry.
TIE_MARGIN = 64
# What a frequency cap counts by: the index field of an ad's group (None: the ad itself).
CAP_GROUPS = {"ad": None, "campaign": "campaign_id", "advertiser": "advertiser_id"}


@dataclass
class Retrieved:
    ad_ids: np.ndarray  # [k'] int64, best first (k' <= k: fewer when fewer are eligible)
    scores: np.ndarray  # [k'] float32
    # With a cap per group: each ad's group value and whether it has one ([k'] int64, bool),
    # which a merge of shards' answers walks again (`m31.engine.caps`)
    groups: tuple[np.ndarray, np.ndarray] | None = None


@dataclass
class RetrievalResult:
    results: list[Retrieved]
    version: int  # index version every request of the batch saw
    timings_ms: dict[str, float] = field(default_factory=dict)  # encode, mask, score_topk


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
        found = search(
            tuple(t[pick] for t in query), view, _mask_of(mask, pick), [ks[r] for r in idx], kernel,
            None if caps is None else [caps[r] for r in idx], [kind] * len(idx),
        )  # fmt: skip
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


def seed_users(feats: Features, length: int) -> UserStore:
    """The user store `feats` seed: every user of the features, their attributes and last
    `length` engagements (rows in the features' order, so a seeded user's row is its feature
    row)."""
    return users_of(feats.meta["vocab"], feats.users, feats.ads["ad_id"], feats.engagements, length)


def users_of(
    vocab: Mapping, users: Mapping[str, np.ndarray], ad_ids: np.ndarray, engagements, length: int
) -> UserStore:
    """`seed_users` from the parts of features it reads: the vocabularies, the users' columns,
    the catalogue's ad ids and the engagement sequences (`EventSequences`, items as catalogue
    rows)."""
    codes = Vocab(
        surfaces=tuple(vocab["surface"]),
        countries=tuple(vocab["country"]),
        genders=tuple(vocab["gender"]),
        cohorts=tuple(vocab["cohort"]),
        n_age_buckets=N_AGE_BUCKETS,
    )
    seq = engagements.last(length)
    user_ids = users["user_id"]
    events = Events(
        user_id=user_ids[np.repeat(np.arange(seq.n_users), np.diff(seq.offsets))],
        ad_id=ad_ids[seq.values["item"]],
        ts=seq.ts,
        surface=seq.values["surface"].astype(np.int16),
    )
    attributes = {a: users[a] for a in USER_ATTRIBUTES}
    return UserStore.seed(length, codes, user_ids, attributes, events)


class Retriever:
    def __init__(
        self,
        model: RetrievalModel,
        feats: Features,
        index: AdIndex,
        users: UserStore | None = None,
    ) -> None:
        """`feats`: the features the model reads (its catalogue; the online ones suffice).
        `users`: the stored users (default: those `feats` seed, `seed_users`), whose targeting
        (country, age, gender) is read from the store; a null one is unknown, which only ads
        without that restriction accept."""
        if not isinstance(model, RetrievalModel):
            raise TypeError(
                f"the engine serves retrieval models (moe, two-tower), not {model.cfg.kind} models"
            )
        self.model = model.eval()
        self.feats = feats
        self.index = index
        self.device = index.device
        self.catalog = Catalog.from_features(feats).to(self.device)
        self.model.to(self.device)
        if users is None:
            # Served (online) features hold each user's last L engagements, which a store of L
            # keeps; full ones every engagement, which a store as long as the longest history
            # keeps, so that a request dated in the past (an offline replay) sees what the
            # model saw in training.
            longest = int(np.diff(feats.engagements.offsets).max(initial=0))
            length = model.cfg.max_len if feats.is_online else max(longest, model.cfg.max_len)
            users = seed_users(feats, length)
        self.users = users
        # Whether a model without gate keys is scored as one query vector (`fold`).
        self.fold = True
        # The clusters to probe instead of scoring every row (`m31.engine.probe.Prober`).
        self.probe = None
        # Whether caps per campaign or advertiser can be answered: they read the ads' groups
        # from `index`, which a cluster's ingress does not hold (`m31.cluster.service`).
        self.group_caps = True
        self._seeded = feats.n_users  # store rows below it are feature rows (organic events)
        vocab = feats.meta["vocab"]
        self._countries = {c: i for i, c in enumerate(vocab["country"])}
        # The model's values of each categorical field: a request naming another is refused.
        self.vocab = {name: tuple(vocab[name]) for name in ("surface", "platform", "gender")}
        self._codes = {name: {v: i for i, v in enumerate(vs)} for name, vs in self.vocab.items()}
        self._cohorts = {int(c): i for i, c in enumerate(vocab["cohort"])}
        # Default cohort of an inline user: the most common one among the stored users of its
        # country who have one; none (the unknown cohort) for a user without a country, or of
        # a country whose users have none.
        u = feats.users
        n_cohorts = len(self._cohorts)
        self._country_cohort = {}
        for c in range(len(self._countries)):
            held = u["cohort"][(u["country"] == c) & (u["cohort"] < n_cohorts)]
            self._country_cohort[c] = int(np.bincount(held).argmax()) if len(held) else n_cohorts
        ad_ids = feats.ads["ad_id"]
        self._ad_order = np.argsort(ad_ids, kind="stable")
        self._ad_sorted = ad_ids[self._ad_order]
        self._n_topics = int(feats.meta["n_topics"])

    def _code(self, name: str, value: str | None) -> int:
        """The code of a checked `value` of vocabulary `name`; None is the unknown value's."""
        codes = self._codes[name]
        return len(codes) if value is None else codes[value]

    def _user_rows(self, ids: np.ndarray, where: list[int]) -> np.ndarray:
        rows = self.users.rows_of(ids)
        bad = np.flatnonzero(rows < 0)
        if len(bad):
            raise RequestError(
                f"requests[{where[bad[0]]}].user_id: unknown user {int(ids[bad[0]])}"
            )
        return rows

    def _catalog_rows(self, ad_ids: np.ndarray) -> np.ndarray:
        """Catalogue row of each ad id, -1 for ads the model's catalogue does not hold."""
        if not len(self._ad_sorted):
            return np.full(len(ad_ids), -1, dtype=np.int64)
        pos = np.minimum(np.searchsorted(self._ad_sorted, ad_ids), len(self._ad_sorted) - 1)
        return np.where(self._ad_sorted[pos] == ad_ids, self._ad_order[pos], -1)

    def _check_inline(self, i: int, u: InlineUser) -> None:
        self._check_user(f"requests[{i}].user", u)

    def _check_user(self, where: str, u: InlineUser) -> None:
        if u.country is not None and u.country not in self._countries:
            known = ", ".join(sorted(self._countries)[:8]) or "none: the users have no country"
            raise RequestError(
                f"{where}.country: unknown country {u.country!r} (known: {known}, …)"
            )
        if u.gender is not None:
            one_of(f"{where}.gender", u.gender, self.vocab["gender"])
        if u.age is not None and not 0 <= u.age < 150:
            raise RequestError(f"{where}.age: {u.age} is not an age")
        if u.cohort is not None and u.cohort not in self._cohorts:
            raise RequestError(f"{where}.cohort: unknown cohort {u.cohort}")
        for j, e in enumerate(u.history):
            if e.surface is not None:
                one_of(f"{where}.history[{j}].surface", e.surface, self.vocab["surface"])
        bad = [t for t in u.organic_topics if not 0 <= t < self._n_topics]
        if bad:
            known = (
                f"0..{self._n_topics - 1}" if self._n_topics else "none: the model has no topics"
            )
            raise RequestError(f"{where}.organic_topics: topic {bad[0]} is outside {known}")

    def _stored_inputs(self, rows: np.ndarray, context: dict[str, np.ndarray]):
        """Inputs of stored users (store rows [B]) as of each request's time: their attributes,
        the engagements the store holds on ads of the model's catalogue (the others it has no
        features for), and the organic events of the users the features seeded."""
        ts = context["ts"]
        attrs, ads, surface, when = self.users.history(rows, ts)  # [B], [B, L] each
        L = self.model.cfg.max_len
        ads, surface, when = ads[:, -L:], surface[:, -L:], when[:, -L:]
        items = np.where(ads >= 0, self._catalog_rows(ads.ravel()).reshape(ads.shape), -1)
        # Right-align the engagements the catalogue holds, in their order.
        order = np.argsort(items >= 0, axis=1, kind="stable")
        items = np.take_along_axis(items, order, 1)
        held = items >= 0
        surface = np.where(held, np.take_along_axis(surface, order, 1), 0)
        when = np.where(held, np.take_along_axis(when, order, 1), -1)
        organic = np.full((len(rows), self.feats.config.organic_len), -1, np.int64)
        seeded = rows < self._seeded
        if seeded.any():
            organic[seeded] = self.feats.organic_history(rows[seeded], ts[seeded])[0]
        demographics = {k: attrs[k] for k in ("cohort", "age_bucket", "gender", "country")}
        serving = {k: context[k] for k in ("surface", "hour", "platform")}
        return request_inputs(demographics, ts, serving, items, surface, when, organic)

    def _inline_inputs(self, requests: Sequence[AdRequest], context: dict[str, np.ndarray]):
        users = [r.user for r in requests]
        histories = []
        for u in users:
            order = sorted(range(len(u.history)), key=lambda j: u.history[j].ts)
            events = [u.history[j] for j in order]
            rows = self._catalog_rows(np.array([e.ad_id for e in events], dtype=np.int64))
            known = rows >= 0
            histories.append(
                (
                    rows[known],
                    np.array([self._code("surface", e.surface) for e in events], dtype=np.int64)[
                        known
                    ],
                    np.array([e.ts for e in events], dtype=np.int64)[known],
                )
            )
        codes = [self._user_codes(u) for u in users]
        return inline_requests(
            self.feats,
            **{a: np.array([c[a] for c in codes]) for a in ("cohort", "age_bucket", "gender")},
            country=np.array([c["country"] for c in codes]),
            histories=histories,
            organic=[np.array(u.organic_topics, dtype=np.int64) for u in users],
            max_len=self.model.cfg.max_len,
            **context,
        )

    def _user_codes(self, u: InlineUser) -> dict[str, int]:
        """The store's codes of a checked user's attributes: what it leaves out (None) is the
        unknown value, no input from it; the cohort defaults to its country's most common."""
        country = self._countries.get(u.country, len(self._countries))
        if u.cohort is not None:
            cohort = self._cohorts[u.cohort]
        else:
            cohort = self._country_cohort.get(country, len(self._cohorts))
        return {
            "cohort": cohort,
            "age_bucket": N_AGE_BUCKETS if u.age is None else int(age_bucket(np.array(u.age))),
            "gender": self._code("gender", u.gender),
            "country": country,
            "age": -1 if u.age is None else int(u.age),
        }

    def user_codes(self, where: str, user: InlineUser) -> dict[str, int]:
        """Check a user's attributes (RequestError naming `where`.field) and give the store's
        codes of them (`UserStore.set_attributes`, the PUT /v1/users route)."""
        self._check_user(where, user)
        return self._user_codes(user)

    def _capped(self, i: int, r: AdRequest, row: int) -> tuple[AdRequest, CompiledFilter | None]:
        """`r` with what its frequency cap leaves out added to its exclusions (or, per campaign,
        to its filter), counted over the store's engagements of the user (row `row`) or the
        inline user's history in the cap's window; and its compiled filter."""
        cap, where = r.frequency_cap, f"requests[{i}].frequency_cap"
        if cap.per not in CAP_GROUPS:
            raise RequestError(f"{where}.per: {cap.per!r} is not one of {', '.join(CAP_GROUPS)}")
        for name in ("max", "window_s"):
            value = getattr(cap, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise RequestError(f"{where}.{name}: must be a positive integer, got {value!r}")
        if r.user is None:
            ((ads, counts),) = self.users.engaged(np.array([row]), np.array([r.ts]), cap.window_s)
        else:
            inside = [e.ad_id for e in r.user.history if r.ts - cap.window_s <= e.ts < r.ts]
            ads, counts = np.unique(np.array(inside, np.int64), return_counts=True)
        field_ = CAP_GROUPS[cap.per]
        if field_ is not None and not self.group_caps:
            raise RequestError(f"{where}.per: {cap.per} caps are not served here (per ad are)")
        if field_ is None:  # per ad
            capped = ads[counts >= cap.max].tolist()
        else:
            if field_ not in self.index.schema:
                raise RequestError(f"{where}.per: the index has no {field_} to cap by")
            groups = self.index.numeric_values(ads, field_)  # None: not (or no longer) held
            totals: dict[int, int] = {}
            for g, c in zip(groups, counts.tolist(), strict=True):
                if g is not None:
                    totals[g] = totals.get(g, 0) + c
            capped = sorted(g for g, c in totals.items() if c >= cap.max)
        filter_ = r.filter
        if capped and cap.per == "ad":
            r = dataclasses.replace(r, exclude_ads=(*r.exclude_ads, *capped))
        elif capped and cap.per == "advertiser":
            r = dataclasses.replace(r, exclude_advertisers=(*r.exclude_advertisers, *capped))
        elif capped:
            clause = {"not": {"in": [field_, capped]}}
            filter_ = clause if filter_ is None else {"all": [filter_, clause]}
            r = dataclasses.replace(r, filter=filter_)
        return r, self._compiled(i, filter_)

    def _check_max_per(self, i: int, max_per: Mapping) -> None:
        where = f"requests[{i}].max_per"
        if not isinstance(max_per, Mapping) or len(max_per) != 1:
            raise RequestError(f'{where}: give one grouping, e.g. {{"advertiser": 2}}')
        ((name, most),) = max_per.items()
        if name not in GROUP_FIELDS:
            raise RequestError(f"{where}: {name!r} is not one of {', '.join(GROUP_FIELDS)}")
        if isinstance(most, bool) or not isinstance(most, numbers.Integral) or most < 1:
            raise RequestError(f"{where}.{name}: must be a positive integer, got {most!r}")
        if self.index.schema.get(GROUP_FIELDS[name]) != "int":
            raise RequestError(f"{where}.{name}: the index has no {GROUP_FIELDS[name]} to cap by")

    def _compiled(self, i: int, tree: Mapping | None) -> CompiledFilter | None:
        try:
            return compile_filter(tree, self.index.schema) if tree else None
        except ValueError as e:
            raise RequestError(f"requests[{i}].filter: {e}") from e

    def prepare(
        self, requests: Sequence[AdRequest], k: int | Sequence[int]
    ) -> list[PreparedRequest]:
        """Check requests without running them (RequestError naming the first bad field),
        resolve their users and compile their filters. `k`: one for all, or one per request."""
        ks = [k] * len(requests) if isinstance(k, numbers.Integral) else list(k)
        if len(ks) != len(requests):
            raise RequestError(f"k: {len(ks)} values for {len(requests)} requests")
        for i, (r, k_) in enumerate(zip(requests, ks, strict=True)):
            if isinstance(k_, bool) or not isinstance(k_, numbers.Integral) or k_ < 1:
                raise RequestError(f"requests[{i}]: k must be positive, got {k_!r}")
            for name in ("surface", "platform"):
                if getattr(r, name) is not None:
                    one_of(f"requests[{i}].{name}", getattr(r, name), self.vocab[name])
            if r.hour is not None and not 0 <= r.hour < 24:
                raise RequestError(f"requests[{i}].hour: {r.hour} is not an hour of day")
            if (r.user_id is None) == (r.user is None):
                raise RequestError(f"requests[{i}]: give exactly one of user_id and user")
            if r.user is not None:
                self._check_inline(i, r.user)
            if r.max_per is not None:
                self._check_max_per(i, r.max_per)
            one_of(f"requests[{i}].rank", r.rank, RANKS)
        rows = np.full(len(requests), -1, dtype=np.int64)  # feature-store row of stored users
        stored = [i for i, r in enumerate(requests) if r.user is None]
        if stored:
            ids = np.array([requests[i].user_id for i in stored], np.int64)
            rows[stored] = self._user_rows(ids, stored)
        prepared = []
        for i, (r, k_, row) in enumerate(zip(requests, ks, rows.tolist(), strict=True)):
            if r.rank == "value":  # only ads with a bid have a value
                r = dataclasses.replace(
                    r, filter=HAS_BID if not r.filter else {"all": [r.filter, HAS_BID]}
                )
            if r.frequency_cap is not None:
                r, compiled = self._capped(i, r, row)
            else:
                compiled = self._compiled(i, r.filter)
            if r.user is not None:
                who = {"country": r.user.country, "age": r.user.age, "gender": r.user.gender}
            else:
                who = self.users.targeting(row)
            prepared.append(PreparedRequest(r, int(k_), row, compiled, who))
        return prepared

    @torch.no_grad()
    def encode(
        self, prepared: Sequence[PreparedRequest]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The query of each prepared request, (q [B, E, G], v [B, E, D], p [B, E]) on the
        index's device: user experts, with the serving context folded in."""
        requests = [one.request for one in prepared]
        context = {
            "ts": np.array([r.ts for r in requests], dtype=np.int64),
            "surface": np.array([self._code("surface", r.surface) for r in requests]),
            "hour": np.array(
                [r.hour if r.hour is not None else (r.ts % 86_400) // 3600 for r in requests]
            ),
            "platform": np.array([self._code("platform", r.platform) for r in requests]),
        }
        stored = [i for i, r in enumerate(requests) if r.user is None]
        inline = [i for i, r in enumerate(requests) if r.user is not None]
        rows = np.array([p.user_row for p in prepared], dtype=np.int64)  # [B]
        parts = []
        if stored:
            parts.append(
                self._stored_inputs(rows[stored], {k_: c[stored] for k_, c in context.items()})
            )
        if inline:
            parts.append(
                self._inline_inputs(
                    [requests[i] for i in inline], {k_: c[inline] for k_, c in context.items()}
                )
            )
        inputs = concat_requests(parts, np.argsort(np.array(stored + inline), kind="stable"))
        q, v, p = self.model.encode_requests(inputs.to(self.device), self.catalog)  # [B, E, *]
        return fold(q, v, p) if self.fold else (q, v, p)

    def _prepared(
        self, requests: Sequence[AdRequest] | Sequence[PreparedRequest], k: int | None
    ) -> list[PreparedRequest]:
        if requests and isinstance(requests[0], PreparedRequest):
            return list(requests)
        if k is None:
            raise RequestError("k: give how many ads each request wants")
        return self.prepare(requests, k)

    @torch.no_grad()
    def retrieve(
        self, requests: Sequence[AdRequest] | Sequence[PreparedRequest], k: int | None = None
    ) -> RetrievalResult:
        """The top `k` eligible ads of each request, best first (ties: the lower ad id).

        Requests as given are prepared first (with `k`); prepared ones keep the k they were
        prepared with, so one batch can mix them: each gets its own first k, which is what it
        would get alone.
        """
        if not requests:
            return RetrievalResult([], self.index.version)
        prepared = self._prepared(requests, k)
        # Encoding and masks are small ops: on one core, where a busy machine cannot stall them
        # on an OpenMP barrier (`m31.ops.threads`); the pass itself uses every core.
        small = single_threaded() if self.device.type == "cpu" else contextlib.nullcontext()
        with small:
            t0 = time.perf_counter()
            query = self.encode(prepared)
            t1 = time.perf_counter()
            # Masks are built from the view's own copy of the attributes and the table's rows
            # are write-once (see m31.index.ad_index): no lock is held, so writers never wait.
            view = self.index.frozen_view()
            mask = eligible_masks(
                view,
                [(request_context(one.request, one.targeting), one.filter) for one in prepared],
            )
            t2 = time.perf_counter()
        ks = [one.k for one in prepared]
        caps = [group_cap(one.request.max_per) for one in prepared]
        valued = [one.request.rank == "value" for one in prepared]
        if self.probe is None:
            results = search(query, view, mask, ks, caps=caps, valued=valued)
        else:
            results, _ = self.probe.search(query, view, mask, ks, caps, valued)
        t3 = time.perf_counter()
        timings = {"encode": t1 - t0, "mask": t2 - t1, "score_topk": t3 - t2}
        return RetrievalResult(
            results, view.version, {k_: round(1000 * v_, 3) for k_, v_ in timings.items()}
        )
