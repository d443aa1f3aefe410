"""Feature pipeline: dataset tables -> model inputs (sequences, cohorts, co-engagement, text)."""

from m31.features.build import build_features
from m31.features.feature_set import FeatureConfig, Features
from m31.features.sequences import EventSequences

__all__ = ["EventSequences", "FeatureConfig", "Features", "build_features"]
