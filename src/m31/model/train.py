"""Training, checkpoints, and the inference API (`encode_ads`, `encode_requests`).

Shapes: B requests in a batch, U uniform negatives, C candidates, A ads, E experts.

Retrieval models train with a sampled softmax over in-batch and uniform negatives with logQ
correction (a candidate's logit minus the log-probability that sampling put it in the set),
plus the gate's load-balancing term. The ranking model trains the same way, but scores each
request against its own small candidate set (its positive, other requests' positives, uniform
negatives), since every (request, ad) pair costs it a full forward pass.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from m31.features import Features
from m31.model.config import ModelConfig
from m31.model.inputs import Catalog, Requests, make_requests
from m31.model.ranking import RankingModel
from m31.model.retrieval import RetrievalModel, balance_loss, expert_usage, sampled_softmax_loss
from m31.ops import score

Log = Callable[[str], None]


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def vocab_sizes(feats: Features) -> dict[str, int]:
    v = feats.meta["vocab"]
    return {
        "cohort": len(v["cohort"]),
        "country": len(v["country"]),
        "topic": int(feats.meta["n_topics"]),
        "category": int(feats.meta["n_categories"]),
    }


def build_model(cfg: ModelConfig, sizes: dict[str, int], text_dim: int, cooc_dim: int):
    cls = RankingModel if cfg.kind == "ranking" else RetrievalModel
    return cls(cfg, sizes, text_dim, cooc_dim)


def requests_for(
    feats: Features, split: dict[str, np.ndarray], rows: np.ndarray, max_len: int
) -> Requests:
    return make_requests(
        feats,
        split["user"][rows],
        split["ts"][rows],
        split["surface"][rows],
        split["hour"][rows],
        split["platform"][rows],
        max_len,
    )


@torch.no_grad()
def encode_ads(model: RetrievalModel, catalog: Catalog, batch: int = 8192):
    """(g [A, G], x [A, D], b [A]) for every ad of `catalog`, in batches."""
    model.eval()
    parts = [
        model.encode_ads(
            catalog.take(
                torch.arange(lo, min(lo + batch, len(catalog)), device=catalog.ad_id.device)
            )
        )
        for lo in range(0, len(catalog), batch)
    ]
    return tuple(torch.cat(p) for p in zip(*parts, strict=True))


@torch.no_grad()
def encode_requests(
    model: RetrievalModel, feats: Features, catalog: Catalog, user, ts, surface, hour, platform
):
    """(q [B, E, G], v [B, E, D], p [B, E]) for requests given as user rows, times and context ids."""
    model.eval()
    device = catalog.ad_id.device
    r = make_requests(feats, user, ts, surface, hour, platform, model.cfg.max_len).to(device)
    return model.encode_requests(r, catalog)


class ScoreFunction:
    """A trained model as `m31.eval` uses it.

    Calling it scores requests (anything with user, ts, surface, hour, platform arrays) against
    the full corpus: [n, A]. `rank` scores given candidates only: [n, k]. Retrieval models encode
    the catalogue once; the ranking model scores ads in chunks of `ad_chunk`.
    """

    def __init__(self, model, feats: Features, catalog: Catalog, ad_chunk: int = 4096):
        self.model, self.feats, self.catalog = model.eval(), feats, catalog
        self.ad_chunk = ad_chunk
        self.device = catalog.ad_id.device
        self._ads = encode_ads(model, catalog) if isinstance(model, RetrievalModel) else None

    def _inputs(self, req) -> Requests:
        return make_requests(
            self.feats,
            req.user,
            req.ts,
            req.surface,
            req.hour,
            req.platform,
            self.model.cfg.max_len,
        ).to(self.device)

    @torch.no_grad()
    def __call__(self, req) -> np.ndarray:
        r = self._inputs(req)
        if self._ads is not None:
            q, v, p = self.model.encode_requests(r, self.catalog)
            return score(q, v, p, *self._ads).cpu().numpy()
        out = np.empty((len(r), len(self.catalog)), dtype=np.float32)
        for lo in range(0, len(self.catalog), self.ad_chunk):
            rows = torch.arange(lo, min(lo + self.ad_chunk, len(self.catalog)), device=self.device)
            out[:, lo : lo + len(rows)] = self.model(r, self.catalog, rows).cpu().numpy()
        return out

    @torch.no_grad()
    def rank(self, req, cand_rows: np.ndarray) -> np.ndarray:
        """Scores [n, k] of candidate ad rows [n, k]: what a ranking stage does."""
        if self._ads is not None:  # retrieval models: the full-corpus scores are cheap
            return np.take_along_axis(self(req), cand_rows, axis=1)
        rows = torch.from_numpy(np.ascontiguousarray(cand_rows, dtype=np.int64)).to(self.device)
        return self.model(self._inputs(req), self.catalog, rows).cpu().numpy()


def _validate(
    model, feats: Features, catalog: Catalog, cfg: ModelConfig, exclude_seen: bool
) -> dict:
    from m31.eval import evaluate

    fn = ScoreFunction(model, feats, catalog)
    res = evaluate(
        {"model": fn},
        feats,
        split="val",
        ks=(10, 50),
        max_users=cfg.val_requests,
        exclude_seen=exclude_seen,
    )
    return res["model"]


def train(
    cfg: ModelConfig,
    feats: Features,
    device: torch.device | str | None = None,
    log: Log = print,
    progress: bool = True,
):
    """Train a model on `feats` (train split; early stopping on the val split's HR@50).

    Returns (model, history) where history holds per-epoch loss, validation metrics, time, and
    for the MoE the experts' usage.
    """
    from rich.progress import (
        BarColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    device = torch.device(device) if device is not None else default_device()
    torch.manual_seed(cfg.seed)
    rng = np.random.default_rng(cfg.seed)
    catalog = Catalog.from_features(feats).to(device)
    model = build_model(
        cfg, vocab_sizes(feats), feats.text_emb.shape[1], feats.cooc_emb.shape[1]
    ).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    train_split = feats.splits["train"]
    n, n_ads = len(train_split["user"]), feats.n_ads
    if n == 0:
        raise ValueError("the train split is empty")
    exclude_seen = feats.meta.get("source") == "movielens"
    pop = np.bincount(train_split["item"], minlength=n_ads) / n  # in-batch sampling probability
    steps = math.ceil(n / cfg.batch_size)
    history: list[dict] = []
    best, best_state, bad_epochs = -1.0, None, 0
    bar = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TextColumn("loss {task.fields[loss]:.3f}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        disable=not progress,
        transient=True,
    )
    with bar:
        for epoch in range(cfg.epochs):
            task = bar.add_task(
                f"{cfg.kind} epoch {epoch + 1}/{cfg.epochs}", total=steps, loss=float("nan")
            )
            model.train()
            start, losses, gates = time.perf_counter(), [], []
            perm = rng.permutation(n)
            for step in range(steps):
                rows = perm[step * cfg.batch_size : (step + 1) * cfg.batch_size]
                r = requests_for(feats, train_split, rows, cfg.max_len).to(device)
                pos = torch.from_numpy(train_split["item"][rows]).to(device)
                if cfg.kind == "ranking":
                    loss = _ranking_step(model, r, catalog, pos, pop, n_ads, cfg, rng, device)
                else:
                    loss, gate = _retrieval_step(
                        model, r, catalog, pos, pop, n_ads, cfg, rng, device
                    )
                    if cfg.kind == "moe" and step % 20 == 0:
                        gates.append(gate.detach().mean((0, 1)))
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
                opt.step()
                losses.append(float(loss.detach()))
                bar.update(task, advance=1, loss=float(np.mean(losses[-50:])))
            bar.remove_task(task)
            val = _validate(model, feats, catalog, cfg, exclude_seen)
            entry = {
                "epoch": epoch + 1,
                "loss": float(np.mean(losses)),
                "seconds": round(time.perf_counter() - start, 1),
                **{f"val_{k}": v for k, v in val.items()},
            }
            if gates:
                entry["experts"] = expert_usage(torch.stack(gates)[:, None, :])
            history.append(entry)
            log(
                f"epoch {epoch + 1}: loss {entry['loss']:.4f}, val HR@10 {val['hr@10']:.4f}, "
                f"HR@50 {val['hr@50']:.4f} ({entry['seconds']:.0f} s)"
                + (f", expert evenness {entry['experts']['evenness']:.3f}" if gates else "")
            )
            if val["hr@50"] > best:
                best, best_state, bad_epochs = val["hr@50"], copy.deepcopy(model.state_dict()), 0
            else:
                bad_epochs += 1
                if bad_epochs >= cfg.patience:
                    log(f"early stop: no validation gain for {cfg.patience} epochs")
                    break
    model.load_state_dict(best_state)
    model.eval()
    return model, history


def _retrieval_step(model, r, catalog, pos, pop, n_ads, cfg, rng, device):
    b = len(pos)
    neg = torch.from_numpy(rng.integers(0, n_ads, cfg.uniform_negatives)).to(device)
    cand = torch.cat([pos, neg])  # [C] in-batch positives, then uniform negatives
    # Probability that a candidate was drawn into the set: by popularity in-batch, or uniformly.
    q = b * torch.from_numpy(pop).to(device)[cand] + cfg.uniform_negatives / n_ads
    scores, gate = model(r, catalog, catalog.take(cand))  # [B, C], [B, C, E]
    loss = sampled_softmax_loss(scores, q.log(), torch.arange(b, device=device), cand, pos)
    if cfg.kind == "moe" and cfg.balance_weight > 0:
        loss = loss + cfg.balance_weight * balance_loss(gate)
    return loss, gate


def _ranking_step(model, r, catalog, pos, pop, n_ads, cfg, rng, device):
    b = len(pos)
    k = min(cfg.ranking_in_batch, b - 1)
    shifts = torch.arange(1, k + 1, device=device)
    in_batch = pos[(torch.arange(b, device=device)[:, None] + shifts[None, :]) % b]  # [B, k]
    uniform = torch.from_numpy(rng.integers(0, n_ads, (b, cfg.ranking_negatives))).to(device)
    cand = torch.cat([pos[:, None], in_batch, uniform], dim=1)  # [B, C]
    q = k * torch.from_numpy(pop).to(device)[cand] + cfg.ranking_negatives / n_ads
    scores = model(r, catalog, cand)
    return sampled_softmax_loss(
        scores, q.log(), torch.zeros(b, dtype=torch.long, device=device), cand, pos
    )


def features_fingerprint(feats: Features) -> str:
    """Identifies the feature set a checkpoint was trained on (catalogue and vocabularies)."""
    h = hashlib.sha256()
    h.update(json.dumps(feats.meta["vocab"], sort_keys=True).encode())
    h.update(np.ascontiguousarray(feats.ads["ad_id"]).tobytes())
    return h.hexdigest()[:16]


def save_checkpoint(path: Path, model, feats: Features, history: list[dict]) -> Path:
    """Weights, config, vocabularies and training history in one file, written atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    blob = {
        "format": "m31-checkpoint-1",
        "config": model.cfg.to_dict(),
        "sizes": vocab_sizes(feats),
        "dims": {"text": int(feats.text_emb.shape[1]), "cooc": int(feats.cooc_emb.shape[1])},
        "vocab": feats.meta["vocab"],
        "features": features_fingerprint(feats),
        "history": history,
        "state_dict": model.state_dict(),
    }
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(blob, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def load_checkpoint(path: Path, feats: Features | None = None, device: str | torch.device = "cpu"):
    """(model, blob). With `feats`, checks that they are the features the model was trained on."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such checkpoint")
    try:
        blob = torch.load(path, map_location=device, weights_only=False)
    except Exception as e:
        raise ValueError(f"{path}: not a readable m31 checkpoint ({e})") from e
    if not isinstance(blob, dict) or blob.get("format") != "m31-checkpoint-1":
        raise ValueError(f"{path}: not an m31 checkpoint")
    if feats is not None and features_fingerprint(feats) != blob["features"]:
        raise ValueError(f"{path}: trained on other features (catalogue or vocabularies differ)")
    cfg = ModelConfig.from_dict(blob["config"])
    model = build_model(cfg, blob["sizes"], blob["dims"]["text"], blob["dims"]["cooc"]).to(device)
    model.load_state_dict(blob["state_dict"])
    model.eval()
    return model, blob
