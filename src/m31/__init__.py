"""m31: an open, GPU-native personalized ads retrieval engine."""

__version__ = "0.1.0"
