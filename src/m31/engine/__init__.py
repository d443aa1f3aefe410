"""The retrieval engine: model + index -> ranked ads per request."""

from m31.engine.retriever import (
    AdRequest,
    Engagement,
    InlineUser,
    RequestError,
    RetrievalResult,
    Retrieved,
    Retriever,
)

__all__ = [
    "AdRequest",
    "Engagement",
    "InlineUser",
    "RequestError",
    "RetrievalResult",
    "Retrieved",
    "Retriever",
]
