"""The retrieval engine: model + index -> ranked ads per request.

requests.py    what is asked: AdRequest (stored or inline user), PreparedRequest
retriever.py   Retriever: prepare (check once) and retrieve (encode, masks, score·top-K),
               composed of the three below, each configured through its constructor
prepare.py     RequestPreparer: checks, users resolved, filters compiled with typed clauses
user_inputs.py UserInputs: the model inputs of stored and inline users; seed_users
search.py      eligible_masks, search (exact top-K, ties to the lower ad id) and merge,
               which the shards of a cluster (m31.cluster) run on their own rows
caps.py        caps per group in the top-K
probe.py       Prober: search over the rows of the best clusters
ad_encoder.py  new ads through the model's ad tower
build.py       offline: the index a trained model makes of a catalogue (`m31 index build`)
load.py        online: what a server or a shard opens to answer
"""

from m31.engine.requests import (
    AdRequest,
    Engagement,
    InlineUser,
    PreparedRequest,
    RequestError,
)
from m31.engine.retriever import Retriever
from m31.engine.search import (
    TIE_MARGIN,
    RetrievalResult,
    Retrieved,
    eligible_masks,
    merge,
    request_context,
    search,
)

__all__ = [
    "TIE_MARGIN",
    "AdRequest",
    "Engagement",
    "InlineUser",
    "PreparedRequest",
    "RequestError",
    "RetrievalResult",
    "Retrieved",
    "Retriever",
    "eligible_masks",
    "merge",
    "request_context",
    "search",
]
