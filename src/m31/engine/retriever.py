"""The retrieval engine: a trained retrieval model and an `AdIndex` -> ranked ads per request.

Shapes: B requests, N rows of the ad table, E experts, G gate-key dim, D value dim, K results.

A `Retriever` is three parts, each configured through its constructor:

* request preparation (`m31.engine.prepare.RequestPreparer`): `Retriever.prepare` checks
  requests once, resolves their users and compiles their filters;
* user inputs (`m31.engine.user_inputs.UserInputs`): `Retriever.encode` reads each request's
  user (a stored user of the user store, or one given inline) with its serving context and
  runs the model's user experts once per batch;
* search (`m31.engine.search`): each request's eligibility as a bitmask over the index's rows
  and the exhaustive score·filter·top-K pass (or, with a `Prober`, the pass over the rows of
  the best clusters).

Table and masks come from one `frozen_view` of the index, so a batch is answered at one
consistent version, and mutations never wait for the masks or the pass. A request that asks
why (`AdRequest.explain`, `why_not`) gets its `m31.engine.explain.Explanation` from the same
view and its query per expert slot, after the pass.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from m31.engine.caps import group_cap
from m31.engine.explain import explain, slot_names
from m31.engine.prepare import GroupLookup, RequestPreparer
from m31.engine.requests import AdRequest, InlineUser, PreparedRequest, RequestError
from m31.engine.search import RetrievalResult, eligible_masks, fold, request_context, search
from m31.engine.user_inputs import UserInputs, UserSource, seed_users
from m31.features import Features
from m31.index import AdIndex
from m31.model import Catalog, RetrievalModel
from m31.ops.threads import single_threaded
from m31.users import UserStore

if TYPE_CHECKING:
    from m31.engine.probe import Prober


class Retriever:
    def __init__(
        self,
        model: RetrievalModel,
        feats: Features,
        index: AdIndex,
        users: UserStore | None = None,
        *,
        fold: bool = True,
        probe: Prober | None = None,
        groups: GroupLookup | None = None,
        source: UserSource | None = None,
    ) -> None:
        """`feats`: the features the model reads (its catalogue; the online ones suffice).
        `users`: the stored users (default: those `feats` seed, `seed_users`), whose targeting
        (country, age, gender) is read from the store; a null one is unknown, which only ads
        without that restriction accept. `fold`: whether a model without gate keys is scored as
        one query vector (`m31.engine.search.fold`). `probe`: the clusters to probe instead of
        scoring every row (`m31.engine.probe.Prober`). `groups`: where frequency caps per
        campaign or advertiser read the ads' groups (default: `index`; `RequestPreparer`).
        `source`: where stored users are read (default: `users`; a cluster's ingress passes
        the owner shards', `UserInputs`)."""
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
        self.inputs = UserInputs(feats, users, model.cfg.max_len, source)
        self.preparer = RequestPreparer(index, self.inputs, groups=groups)
        self.fold = fold
        self.probe = probe

    @property
    def vocab(self) -> dict[str, tuple[str, ...]]:
        """The model's values of each categorical field of a request (surface, platform,
        gender): a request naming another is refused."""
        return self.inputs.vocab

    def user_codes(self, where: str, user: InlineUser) -> dict[str, int]:
        """Check a user's attributes (RequestError naming `where`.field) and give the store's
        codes of them (`UserStore.set_attributes`, the PUT /v1/users route)."""
        self.inputs.check(where, user)
        return self.inputs.codes(user)

    def prepare(
        self, requests: Sequence[AdRequest], k: int | Sequence[int]
    ) -> list[PreparedRequest]:
        """Check requests without running them (RequestError naming the first bad field),
        resolve their users and compile their filters. `k`: one for all, or one per request."""
        return self.preparer.prepare(requests, k)

    @torch.no_grad()
    def encode(
        self, prepared: Sequence[PreparedRequest]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The query of each prepared request, (q [B, E, G], v [B, E, D], p [B, E]) on the
        index's device: user experts, with the serving context folded in."""
        experts = self.encode_experts(prepared)
        return fold(*experts) if self.fold else experts

    @torch.no_grad()
    def encode_experts(self, prepared: Sequence[PreparedRequest]):
        """`encode`'s query before folding: (q, v, p) per expert slot, [B, E, *]."""
        inputs = self.inputs.of(prepared)
        return self.model.encode_requests(inputs.to(self.device), self.catalog)  # [B, E, *]

    def _prepared(
        self, requests: Sequence[AdRequest] | Sequence[PreparedRequest], k: int | None
    ) -> list[PreparedRequest]:
        if requests and isinstance(requests[0], PreparedRequest):
            return list(requests)
        if k is None:
            raise RequestError("k: give how many ads each request wants")
        return self.prepare(requests, k)

    @property
    def expert_names(self) -> list[str]:
        """The names of the model's expert slots, as explanations give them (`slot_names`; a
        two-tower model's one query over every family: "user")."""
        return ["user"] if self.model.cfg.kind == "two-tower" else slot_names(self.model.user.slots)

    def _explain(self, prepared, asked: list[int], experts, query, view, results) -> None:
        """Each asked request's `Explanation` on its result (`m31.engine.explain`), from its
        query per expert slot and the query the pass scored."""
        names = self.expert_names
        for i in asked:
            one = prepared[i]
            results[i].explanation = explain(
                view,
                request_context(one.request, one.targeting),
                one.filter,
                tuple(t[i] for t in experts),
                tuple(t[i] for t in query),
                results[i],
                one.k,
                group_cap(one.request.max_per),
                one.request.rank == "value",
                names,
                one.request.why_not,
                own_filter=one.request.filter,
                clauses=one.clauses,
                split=one.request.explain,
            )

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
            experts = self.encode_experts(prepared)
            query = fold(*experts) if self.fold else experts
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
        asked = [i for i, one in enumerate(prepared) if one.request.explain or one.request.why_not]
        if asked:  # small ops again, on one core
            with single_threaded() if self.device.type == "cpu" else contextlib.nullcontext():
                self._explain(prepared, asked, experts, query, view, results)
        timings = {"encode": t1 - t0, "mask": t2 - t1, "score_topk": t3 - t2}
        if asked:
            timings["explain"] = time.perf_counter() - t3
        return RetrievalResult(
            results, view.version, {k_: round(1000 * v_, 3) for k_, v_ in timings.items()}
        )
