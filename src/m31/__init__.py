"""m31: an open, GPU-native personalized ads retrieval engine.

The library's face (`m31.api`; imported on first use, so that `import m31` stays light):

    m31.load_model(checkpoint, data)     a trained model with the features it reads
    m31.build_index(model, ads, dtype)   its ad tower over a catalogue -> an AdIndex
    m31.Engine(model, index)             .retrieve(request or requests, k, explain, why_not),
                                         .save(folder)
    m31.Engine.open(folder, checkpoint)  from a saved index: no dataset folder
    m31.AdRequest, m31.InlineUser, m31.Engagement     what is asked (`m31.engine.requests`)
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "Engine": "m31.api",
    "Model": "m31.api",
    "build_index": "m31.api",
    "load_model": "m31.api",
    "AdRequest": "m31.engine.requests",
    "Engagement": "m31.engine.requests",
    "InlineUser": "m31.engine.requests",
    "RequestError": "m31.engine.requests",
    "Retrieved": "m31.engine.retriever",
    "Explanation": "m31.engine.explain",
}
__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'm31' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
