"""The features of a dataset folder, built once and kept.

Features are derived data: `features_for(DIR)` builds them on first use into
`DIR/features/<split>` (atomically) and loads them from there afterwards, rebuilding them when
they were built under an older split rule or format (`m31.features.build.SPLIT_RULE`,
`FEATURES_FORMAT`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from m31.data import dataset
from m31.features.build import FEATURES_FORMAT, SPLIT_RULE, build_features
from m31.features.embedding_cache import embedding_cache_dir
from m31.features.feature_set import FeatureConfig, Features

Progress = Callable[[str, int, int], None]


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
        built = (feats.meta.get("split_rule"), feats.meta.get("features_format"))
        if built == (SPLIT_RULE, FEATURES_FORMAT):
            return feats
    feats = build_features(
        dataset.load(data),
        FeatureConfig(split=split),
        cache_dir=embedding_cache_dir(),
        progress=progress,
    )
    feats.save(out, overwrite=True)
    return feats
