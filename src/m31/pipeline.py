"""Glue between the stages: a dataset folder's features, built once, and funnel eligibility.

Features are derived data: `features_for(DIR)` builds them on first use into
`DIR/features/<split>` (atomically) and loads them from there afterwards, rebuilding them when
they were built under an older split rule or format (`m31.features.build.SPLIT_RULE`,
`FEATURES_FORMAT`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import numpy as np

from m31.data import dataset
from m31.features import FeatureConfig, Features, build_features
from m31.features.build import FEATURES_FORMAT, SPLIT_RULE

Progress = Callable[[str, int, int], None]


def embedding_cache_dir() -> Path:
    """Where text embeddings are cached: $M31_CACHE/embeddings (default ~/.cache/m31)."""
    return Path(os.environ.get("M31_CACHE", "~/.cache/m31")).expanduser() / "embeddings"


def features_for(
    data: Path, split: str = "leave-last-out", progress: Progress | None = None
) -> Features:
    """The features of a dataset folder (or a features folder itself), built once and kept."""
    data = Path(data)
    if (data / "text_emb.npy").is_file():
        return Features.load(data)
    out = data / "features" / split
    if (out / "meta.json").is_file():
        feats = Features.load(out)
        if (feats.meta.get("split_rule"), feats.meta.get("features_format")) == (
            SPLIT_RULE,
            FEATURES_FORMAT,
        ):
            return feats
    feats = build_features(
        dataset.load(data),
        FeatureConfig(split=split),
        cache_dir=embedding_cache_dir(),
        progress=progress,
    )
    feats.save(out, overwrite=True)
    return feats


def funnel_eligibility(data: Path, feats: Features) -> Callable[[np.ndarray], np.ndarray]:
    """ts [n] -> [n, A]: the ads that may be shown at each request time (active, created)."""
    ads = dataset.load(Path(data)).ads
    active = np.asarray(ads["status"].to_pylist()) == "active"  # [A]
    created = feats.ads["created_at"]  # [A]
    return lambda ts: active[None, :] & (created[None, :] <= np.asarray(ts)[:, None])
