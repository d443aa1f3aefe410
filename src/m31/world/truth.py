"""The ground-truth response model of the synthetic marketplace.

Shapes: U users, A ads, F facets per user (padded), L latent dim, T leaf topics, C categories,
n requests, c candidate ads per request.

For a user u, ad a and context (surface s, hour h, platform p) at time t:

    z_f      = kappa * cos(u_f, a) + w_f(t)                  # facet f's match, w drifts in time
    affinity = logsumexp_f(beta * z_f) / beta                # soft max over facets: multi-modal
    click    = sigmoid(c0 + affinity + 0.3 q_a + SF[s, fmt_a] + HC[h, cat_a] + PO[p, obj_a])
    cvr      = sigmoid(v0 + 0.6 affinity + 0.4 q_a + OBJ[obj_a] + PO[p, obj_a])
    p_conv   = click * cvr

The soft max over several facets is what no single dot product can represent; the surface x
format, hour x category and platform x objective terms make the best ad depend on the context.
User and ad arguments are row numbers (in the synthetic world, ids equal row numbers).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

CLICK_BIAS = -6.5
CVR_BIAS = -4.0
# Per objective (clicks, conversions, app_installs): how readily a click turns into a conversion.
OBJECTIVE_CVR = np.array([-1.0, 0.0, -0.3], dtype=np.float32)


@dataclass
class GroundTruth:
    facet_vec: np.ndarray  # [U, F, L] unit vectors (zeros where padded)
    facet_w0: np.ndarray  # [U, F] log-weight at the start of the log (-1e4 where padded)
    facet_drift: np.ndarray  # [U, F] change of the log-weight over the whole log
    facet_topic: np.ndarray  # [U, F] leaf topic of each facet (-1 where padded)
    ad_vec: np.ndarray  # [A, L] unit vectors
    ad_quality: np.ndarray  # [A]
    ad_format: np.ndarray  # [A] index into m31.vocabularies.FORMATS
    ad_category: np.ndarray  # [A]
    ad_objective: np.ndarray  # [A] index into m31.vocabularies.OBJECTIVES
    surface_format: np.ndarray  # [S, 3] logit bonus of a format on a surface
    hour_category: np.ndarray  # [24, C] logit bonus of a category at an hour of day
    platform_objective: np.ndarray  # [P, 3] logit bonus of an objective on a platform
    topic_vec: np.ndarray  # [T, L]
    t0: int  # start of the event log (Unix seconds)
    span: int  # length of the event log (seconds)
    beta: float
    kappa: float

    def to_arrays(self) -> dict[str, np.ndarray]:
        return {k: np.asarray(v) for k, v in self.__dict__.items()}

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray]) -> GroundTruth:
        kw = {k: arrays[k] for k in cls.__dataclass_fields__}
        for k in ("t0", "span"):
            kw[k] = int(kw[k])
        for k in ("beta", "kappa"):
            kw[k] = float(kw[k])
        return cls(**kw)

    @property
    def n_users(self) -> int:
        return self.facet_vec.shape[0]

    @property
    def n_ads(self) -> int:
        return self.ad_vec.shape[0]

    def affinity(self, users: np.ndarray, ads: np.ndarray, ts: np.ndarray) -> torch.Tensor:
        """Soft max over facets of the facet-ad match: users [n], ads [m, c], ts [n] -> [n, c].

        Candidates are shared by blocks of users: with n = m * g, users g*i .. g*i+g-1 are all
        scored against ads[i]. That turns the match into m dense products instead of n*c gathers
        of ad vectors (m = n: a candidate list per user; m = 1: every user against one list).
        """
        n, (m, c) = len(users), ads.shape
        if n % m:
            raise ValueError(f"{n} users cannot share {m} candidate lists evenly")
        g, n_f, dim = n // m, self.facet_vec.shape[1], self.facet_vec.shape[2]
        idx = torch.from_numpy(np.ascontiguousarray(ads, dtype=np.int64)).reshape(-1)
        av = torch.from_numpy(self.ad_vec).index_select(0, idx).view(m, c, dim)  # [m, c, L]
        u = torch.from_numpy(np.asarray(users, dtype=np.int64))
        fv = torch.from_numpy(self.facet_vec).index_select(0, u).view(m, g * n_f, dim)
        cos = torch.bmm(fv, av.transpose(1, 2)).view(n, n_f, c)  # [n, F, c]
        z = self.kappa * cos + self._facet_weights(u, ts)[:, :, None]  # [n, F, c]
        return torch.logsumexp(self.beta * z, dim=1) / self.beta  # [n, c]

    def _facet_weights(self, u: torch.Tensor, ts: np.ndarray) -> torch.Tensor:
        """Users' facet log-weights at times ts, drifted linearly over the log: [n], [n] -> [n, F]."""
        frac = torch.from_numpy(((ts - self.t0) / self.span).astype(np.float32))  # [n]
        w0 = torch.from_numpy(self.facet_w0).index_select(0, u)
        return w0 + frac[:, None] * torch.from_numpy(self.facet_drift).index_select(0, u)

    def facet_share(self, users: np.ndarray, ts: np.ndarray, k: int) -> np.ndarray:
        """[n]: the share of each user's true top-k ads by affinity at time ts that a facet other
        than the user's heaviest at that time wins (has the largest match z_f).

        0 when one vector per user, aimed at the heaviest facet, could find them all; where it is
        large, the best ads of one request answer several interests, which several user vectors
        routed per ad can serve and one dot product cannot."""
        users, ts = np.asarray(users, dtype=np.int64), np.asarray(ts)
        if not 1 <= k <= self.n_ads:
            raise ValueError(f"k must be in [1, {self.n_ads}], got {k}")
        if len(users) != len(ts):
            raise ValueError(f"{len(users)} users but {len(ts)} times")
        out = np.empty(len(users), dtype=np.float64)
        chunk = max(1, (1 << 24) // (self.n_ads * self.facet_vec.shape[1]))
        every = np.arange(self.n_ads)[None, :]
        for lo in range(0, len(users), chunk):
            u, t = users[lo : lo + chunk], ts[lo : lo + chunk]
            top = self.affinity(u, every, t).topk(k, dim=1).indices  # [n, k]
            fv = torch.from_numpy(self.facet_vec[u])  # [n, F, L]
            w = self._facet_weights(torch.from_numpy(u), t)  # [n, F]
            ads = torch.from_numpy(self.ad_vec)[top]  # [n, k, L]
            z = self.kappa * torch.einsum("nfl,nkl->nfk", fv, ads) + w[:, :, None]
            other = z.argmax(1) != w.argmax(1)[:, None]  # [n, k]
            out[lo : lo + chunk] = other.double().mean(1).numpy()
        return out

    def interest_mix(self, ks: tuple[int, ...] = (10, 100)) -> dict:
        """How much the best ads mix each user's interests (`facet_share` at the log's end, at
        each K of `ks`), over a seeded sample of up to 500 users (fewer on a large catalogue:
        each costs a pass over every ad); with the mean number of facets per user."""
        users = max(100, min(500, 25_000_000 // self.n_ads))
        rows = np.random.default_rng(0).permutation(self.n_users)[:users]
        ts = np.full(len(rows), self.t0 + self.span)
        return {
            "users": len(rows),
            "facets_per_user": float((self.facet_topic >= 0).sum(1).mean()),
            "other_facet_share": {
                k: float(self.facet_share(rows, ts, k).mean()) for k in ks if k <= self.n_ads
            },
        }

    def logits(
        self,
        users: np.ndarray,
        ads: np.ndarray,
        surface: np.ndarray,
        hour: np.ndarray,
        platform: np.ndarray,
        ts: np.ndarray,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Click and conversion-given-click logits: users, contexts [n]; ads [m, c] shared by
        blocks of n / m users (see `affinity`) -> two [n, c] tensors."""
        aff = self.affinity(users, ads, ts)  # [n, c]
        rep = len(users) // ads.shape[0]
        fmt = np.repeat(self.ad_format[ads], rep, axis=0)
        cat = np.repeat(self.ad_category[ads], rep, axis=0)
        obj = np.repeat(self.ad_objective[ads], rep, axis=0)
        q = torch.from_numpy(np.repeat(self.ad_quality[ads], rep, axis=0))
        sf = torch.from_numpy(self.surface_format[surface[:, None], fmt])
        hc = torch.from_numpy(self.hour_category[hour[:, None], cat])
        po = torch.from_numpy(self.platform_objective[platform[:, None], obj])
        click = CLICK_BIAS + aff + 0.3 * q + sf + hc + po
        cvr = CVR_BIAS + 0.6 * aff + 0.4 * q + torch.from_numpy(OBJECTIVE_CVR[obj]) + po
        return click, cvr

    def probabilities(
        self, users, ads, surface, hour, platform, ts
    ) -> tuple[np.ndarray, np.ndarray]:
        """(p_click, p_conversion) for each (request, candidate): [n, c] each, float32.

        `ads` is [m, c], shared by blocks of n / m requests, as in `affinity`."""
        click, cvr = self.logits(users, ads, surface, hour, platform, ts)
        p_click = torch.sigmoid(click)
        return p_click.numpy(), (p_click * torch.sigmoid(cvr)).numpy()

    def conversion_matrix(
        self,
        users: np.ndarray,
        surface: int,
        hour: int,
        platform: int,
        ts: int,
        ads: np.ndarray | None = None,
        chunk: int = 256,
    ) -> np.ndarray:
        """True conversion probability of every (user, ad) in one context: [len(users), A]."""
        users = np.asarray(users, dtype=np.int64)
        ads = np.arange(self.n_ads) if ads is None else np.asarray(ads, dtype=np.int64)
        out = np.empty((len(users), len(ads)), dtype=np.float32)
        for lo in range(0, len(users), chunk):
            u = users[lo : lo + chunk]
            n = len(u)
            ctx = [np.full(n, x, dtype=np.int64) for x in (surface, hour, platform, ts)]
            out[lo : lo + n] = self.probabilities(u, ads[None, :], *ctx)[1]
        return out
