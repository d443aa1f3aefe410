"""Hot operations, each a public dispatcher over implementations of one stem (DESIGN §5)."""

from m31.ops.torch_score import gate_weights, score

__all__ = ["gate_weights", "score"]
