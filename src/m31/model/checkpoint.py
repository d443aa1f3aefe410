"""Checkpoints: a trained model with its config, vocabularies and history in one file.

A checkpoint also records a fingerprint of the features it was trained on, so that it is never
loaded beside another catalogue, and the split it was trained on (its name and a digest of its
train examples), so that it is never evaluated on a split whose test period it has seen.
`checkpoint_hash` names it in the index snapshots its ad tower made.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import torch

from m31.data.dataset import VOCABULARIES
from m31.data.schema import N_AGE_BUCKETS
from m31.features import Features
from m31.files import write_file_atomic
from m31.model.config import ModelConfig
from m31.model.dense import DenseModel
from m31.model.ranking import RankingModel
from m31.model.retrieval import RetrievalModel

# 2: records the training split; 3: categorical embeddings sized from the data's vocabularies;
# 4: cohort, country, age bucket, topic and category embeddings have an unknown row too
FORMAT = "m31-checkpoint-4"


def vocab_sizes(feats: Features) -> dict[str, int]:
    """The number of rows of each categorical embedding, the one place they are sized from.

    One row more than the vocabulary: a null (an optional column the data leaves empty) or a
    value the vocabulary does not hold (one first seen online, a new format on an upserted ad)
    embeds as that last row, fixed at zero: no input (`towers.vocab_embedding`).
    """
    v = feats.meta["vocab"]
    return {
        **{name: len(v[name]) + 1 for name in VOCABULARIES},
        "cohort": len(v["cohort"]) + 1,
        "country": len(v["country"]) + 1,
        "age": N_AGE_BUCKETS + 1,
        "topic": int(feats.meta["n_topics"]) + 1,
        "category": int(feats.meta["n_categories"]) + 1,
        # not a vocabulary: the item-attribute tokens per ad, 0 when the data declares none
        "attributes": int(feats.attr_tokens.shape[1]),
    }


def build_model(cfg: ModelConfig, sizes: dict[str, int], text_dim: int, cooc_dim: int):
    cls = {"ranking": RankingModel, "dense": DenseModel}.get(cfg.kind, RetrievalModel)
    return cls(cfg, sizes, text_dim, cooc_dim)


def features_fingerprint(feats: Features) -> str:
    """Identifies the feature set a checkpoint was trained on (catalogue and vocabularies)."""
    h = hashlib.sha256()
    h.update(json.dumps(feats.meta["vocab"], sort_keys=True).encode())
    h.update(np.ascontiguousarray(feats.ads["ad_id"]).tobytes())
    return h.hexdigest()[:16]


def split_fingerprint(feats: Features) -> dict[str, str]:
    """The split a model learns from: its name and a digest of its train examples (which the
    split's per-user train cutoffs determine)."""
    h = hashlib.sha256()
    train = feats.splits["train"]
    for name in sorted(train):
        h.update(name.encode())
        h.update(np.ascontiguousarray(train[name]).tobytes())
    return {"name": feats.config.split, "train": h.hexdigest()[:16]}


def check_trained_on(blob: dict, feats: Features, path: Path) -> None:
    """Refuse features other than those the checkpoint `blob` (read from `path`) was trained
    on. Online features (`Features.online`) hold no examples: their catalogue and vocabularies
    are checked, not the split (serving evaluates nothing)."""
    if features_fingerprint(feats) != blob["features"]:
        raise ValueError(f"{path}: trained on other features (catalogue or vocabularies differ)")
    if feats.is_online:
        return
    trained, given = blob["split"], split_fingerprint(feats)
    if trained["name"] != given["name"]:
        raise ValueError(
            f"{path}: trained on the {trained['name']} split, these features are the "
            f"{given['name']} split (its test period may be in the model's training data)"
        )
    if trained["train"] != given["train"]:
        raise ValueError(
            f"{path}: trained on other {given['name']} train examples than these features hold "
            "(were the features rebuilt with another cutoff?)"
        )


def save_checkpoint(path: Path, model, feats: Features, history: list[dict]) -> Path:
    """Weights, config, vocabularies and training history in one file, written atomically."""
    blob = {
        "format": FORMAT,
        "config": model.cfg.to_dict(),
        "sizes": vocab_sizes(feats),
        "dims": {"text": int(feats.text_emb.shape[1]), "cooc": int(feats.cooc_emb.shape[1])},
        "vocab": feats.meta["vocab"],
        "features": features_fingerprint(feats),
        "split": split_fingerprint(feats),
        "history": history,
        "state_dict": model.state_dict(),
    }
    return save_atomic(blob, path)


def save_atomic(blob: dict, path: Path) -> Path:
    """`torch.save(blob)` to `path`, whole or not at all (`m31.files.write_file_atomic`)."""
    return write_file_atomic(path, lambda f: torch.save(blob, f))


def load_checkpoint(path: Path, feats: Features | None = None, device: str | torch.device = "cpu"):
    """(model, blob). With `feats`, checks that they are the features and split the model was
    trained on (`check_trained_on`); without, the caller checks before using it with any."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such checkpoint")
    try:
        blob = torch.load(path, map_location=device, weights_only=False)
    except Exception as e:
        raise ValueError(f"{path}: not a readable m31 checkpoint ({e})") from e
    if not isinstance(blob, dict) or not str(blob.get("format", "")).startswith("m31-checkpoint"):
        raise ValueError(f"{path}: not an m31 checkpoint")
    if blob["format"] != FORMAT:
        raise ValueError(
            f"{path}: written by an older m31 ({blob['format']}), whose embeddings lack the "
            f"rows this one reads ({FORMAT}): retrain it"
        )
    if feats is not None:
        check_trained_on(blob, feats, path)
    cfg = ModelConfig.from_dict(blob["config"])
    model = build_model(cfg, blob["sizes"], blob["dims"]["text"], blob["dims"]["cooc"]).to(device)
    model.load_state_dict(blob["state_dict"])
    model.eval()
    return model, blob


def checkpoint_hash(path: Path) -> str:
    """Identifies a checkpoint file: what an index snapshot records as its `model_hash`."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]
