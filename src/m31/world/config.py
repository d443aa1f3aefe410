"""Configuration of the synthetic ads marketplace, with named presets."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace

# 2026-01-01T00:00:00Z: the start of the event log; ads may have been created before it.
EPOCH = 1_767_225_600
DAY = 86_400


@dataclass(frozen=True)
class WorldConfig:
    n_users: int
    n_advertisers: int
    n_ads: int
    n_impressions: int
    days: int = 28  # length of the event log
    organic_per_user: float = 24.0  # mean organic (non-ad) engagements per user
    latent_dim: int = 32  # dimension of the ground truth's topic space
    max_facets: int = 4  # users have 2..max_facets interest facets
    candidates: int = 48  # ads the delivery policy considers per impression
    explore: float = 0.1  # share of impressions given to a random eligible candidate
    policy_noise: float = 1.0  # scale of the Gumbel noise in the policy's estimate
    facet_sharpness: float = 4.0  # beta: how close the soft max over facets is to a hard max
    match_gain: float = 5.0  # kappa: logit gain of a perfect facet-ad match
    ad_noise: float = 0.45  # spread of ad vectors around their topic's vector
    facet_noise: float = 0.35  # spread of user facets around their topic's vector
    # Scale of the spread of a user's facet log-weights (std 0.7) and of their drift over the
    # log (std 1.0): 1 lets one facet dominate most users' best ads, 0 weighs them all alike.
    facet_weight_scale: float = 1.0
    # The ads table publishes an estimate of each ad's quality, never the truth the ground
    # truth scores with: corr(estimate, truth) = 1 / sqrt(1 + quality_noise²), 0.71 at 1.0.
    quality_noise: float = 1.0

    def __post_init__(self) -> None:
        for name in ("n_users", "n_advertisers", "n_ads", "n_impressions", "days"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not self.quality_noise >= 0:
            raise ValueError(f"quality_noise must be >= 0, got {self.quality_noise}")
        if self.max_facets < 2:
            raise ValueError(f"max_facets must be at least 2, got {self.max_facets}")
        if not (math.isfinite(self.facet_weight_scale) and self.facet_weight_scale >= 0):
            raise ValueError(
                f"facet_weight_scale must be a finite number >= 0, got {self.facet_weight_scale}"
            )
        if not 0.0 <= self.explore <= 1.0:
            raise ValueError(f"explore must be in [0, 1], got {self.explore}")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> WorldConfig:
        """The config a world's meta.json records; fields added since take their defaults."""
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown world settings {sorted(unknown)}")
        return cls(**d)

    def with_overrides(self, **kw) -> WorldConfig:
        return replace(self, **{k: v for k, v in kw.items() if v is not None})


PRESETS: dict[str, WorldConfig] = {
    # seconds to generate; what tests use
    "tiny": WorldConfig(n_users=500, n_advertisers=40, n_ads=2_000, n_impressions=40_000),
    # the default of `make demo`: trains in minutes on 2 CPU cores
    "demo": WorldConfig(n_users=20_000, n_advertisers=1_000, n_ads=50_000, n_impressions=2_000_000),
    # catalogue-scale: 1 M ads, 100 K users
    "bench": WorldConfig(
        n_users=100_000, n_advertisers=20_000, n_ads=1_000_000, n_impressions=4_000_000
    ),
}


def preset(name: str) -> WorldConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}") from None
