"""Evaluation records: what one `m31 eval` scored, kept so that a later evaluation can compare
with it without the checkpoints (`m31 eval --record`, `--from-record`; DESIGN §8).

Shapes: n test requests.

A training that takes hours is evaluated once; its record then joins every later table, plot
and paired comparison on the same requests, on any machine. A record holds, for each model (or
baseline) and training seed it scored, the 0-based rank of every request's target after the
exclusions, from which HR@K and NDCG@K at any K follow (`m31.eval.stats.per_request`); on a
synthetic world, each request's truth recall at the record's cut-offs; each model's FLOPs per
pair; each checkpoint's file name and training history. It carries a fingerprint of the
requests it was measured on (users, times, contexts, targets, the corpus size, whether the seen
ads were excluded), and is only ever read beside an evaluation of the same requests.

The file is a NumPy `.npz` (no pickles): the arrays, and the rest as one JSON document.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from m31.eval.offline import Requests
from m31.files import write_file_atomic

FORMAT = "m31-eval-record-1"


def requests_fingerprint(req: Requests, target: np.ndarray, n_ads: int, exclude_seen: bool) -> str:
    """Identifies an evaluation's requests: two evaluations with the same fingerprint rank the
    same targets among the same ads for the same users, times and contexts."""
    h = hashlib.sha256(f"{len(req)} {n_ads} {bool(exclude_seen)}".encode())
    for name in ("user", "ts", "surface", "hour", "platform"):
        h.update(np.ascontiguousarray(getattr(req, name), dtype="<i8").tobytes())
    h.update(np.ascontiguousarray(target, dtype="<i8").tobytes())
    return h.hexdigest()[:32]


@dataclass
class RecordedRun:
    """One training seed of a model (or a baseline) as scored."""

    model: str
    ranks: np.ndarray  # [n] 0-based rank of each request's target
    truth_recall: dict[str, np.ndarray] | None = None  # truth_recall@K -> [n], synthetic worlds
    source: str = ""  # the checkpoint's file name; "baseline", or "FIRST>SECOND" for a rerank
    history: list[dict] | None = None  # the checkpoint's training history, per epoch
    val_metric: str | None = None  # the one its best epoch was chosen on

    def training(self) -> str | None:
        """How it was trained, in words: the epoch kept, of how many, and the minutes."""
        if not self.history or self.val_metric is None:
            return None
        key = f"val_{self.val_metric}"
        epochs = [h for h in self.history if h.get("epoch", 0) > 0 and key in h]
        if not epochs:
            return None
        best = max(epochs, key=lambda h: h[key])
        minutes = sum(h.get("seconds", 0.0) for h in epochs) / 60
        return (
            f"best epoch {best['epoch']} of {epochs[-1]['epoch']} (validation {self.val_metric} "
            f"{best[key]:.4f}), {minutes:.0f} min"
        )


@dataclass
class Record:
    fingerprint: str  # `requests_fingerprint`
    data: str  # the dataset folder's name, to say where a mismatched record came from
    ks: tuple[int, ...]  # the cut-offs of the truth recall, where measured
    runs: list[RecordedRun]
    flops: dict[str, int] = field(default_factory=dict)  # model -> FLOPs per pair

    @property
    def requests(self) -> int:
        return len(self.runs[0].ranks) if self.runs else 0


def save_record(record: Record, path: Path | str) -> Path:
    """Write `record` to `path`, whole or not at all (`m31.files.write_file_atomic`)."""
    if not record.runs:
        raise ValueError("an evaluation record needs at least one scored model")
    arrays: dict[str, np.ndarray] = {}
    runs = []
    for i, run in enumerate(record.runs):
        ranks = np.asarray(run.ranks, dtype=np.int64)
        # the smallest type that holds them (under 65,536 ads: 2 bytes a request, before zip)
        small = np.uint16 if ranks.size == 0 or ranks.max() < 2**16 else np.int64
        arrays[f"ranks_{i}"] = ranks.astype(small)
        for key, values in (run.truth_recall or {}).items():
            arrays[f"truth_{i}_{key.removeprefix('truth_recall@')}"] = np.asarray(values)
        runs.append(
            {
                "model": run.model,
                "source": run.source,
                "history": run.history,
                "val_metric": run.val_metric,
                "truth": run.truth_recall is not None,
            }
        )
    doc = {
        "format": FORMAT,
        "fingerprint": record.fingerprint,
        "data": record.data,
        "requests": record.requests,
        "ks": list(record.ks),
        "flops": record.flops,
        "runs": runs,
    }
    arrays["meta"] = np.frombuffer(json.dumps(doc).encode(), dtype=np.uint8)
    return write_file_atomic(path, lambda f: np.savez_compressed(f, **arrays))


def load_record(path: Path | str) -> Record:
    """The record at `path`, checked to be whole and of this format."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such evaluation record")
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
        doc = json.loads(arrays.pop("meta").tobytes().decode())
    except Exception as e:
        raise ValueError(f"{path}: not a readable m31 evaluation record ({e})") from e
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ValueError(f"{path}: not an m31 evaluation record ({FORMAT})")
    try:
        ks = tuple(int(k) for k in doc["ks"])
        runs = []
        for i, run in enumerate(doc["runs"]):
            truth = None
            if run["truth"]:
                truth = {f"truth_recall@{k}": arrays[f"truth_{i}_{k}"] for k in ks}
            ranks = arrays[f"ranks_{i}"].astype(np.int64)
            runs.append(
                RecordedRun(
                    run["model"], ranks, truth, run["source"], run["history"], run["val_metric"]
                )
            )
        record = Record(doc["fingerprint"], doc["data"], ks, runs, dict(doc["flops"]))
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{path}: a damaged m31 evaluation record ({e!r} missing or wrong)") from e
    n = doc.get("requests")
    if (
        not runs
        or any(r.ranks.shape != (n,) for r in runs)
        or any(v.shape != (n,) for r in runs for v in (r.truth_recall or {}).values())
    ):
        raise ValueError(
            f"{path}: a damaged m31 evaluation record (not {n} requests in each array)"
        )
    return record
