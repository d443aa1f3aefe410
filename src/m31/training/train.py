"""Training of the retrieval models and the ranking model.

Shapes: B requests in a batch, U uniform negatives, C candidates, A ads, E experts.

Retrieval models train with a sampled softmax over in-batch and uniform negatives with logQ
correction (a candidate's logit minus the log-probability that sampling put it in the set),
plus the gate's load-balancing term. The ranking model trains the same way, but scores each
request against its own small candidate set (its positive, other requests' positives, uniform
negatives), since every (request, ad) pair costs it a full forward pass. Early stopping reads
the validation split through `m31.eval`, which is why training lives outside `m31.model`.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable

import numpy as np
import torch

from m31.eval import evaluate
from m31.features import Features
from m31.model.checkpoint import build_model, vocab_sizes
from m31.model.config import ModelConfig
from m31.model.inference import ScoreFunction
from m31.model.inputs import Catalog, Requests, make_requests
from m31.model.retrieval import balance_loss, expert_usage, sampled_softmax_loss

Log = Callable[[str], None]


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


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


def _validate(
    model, feats: Features, catalog: Catalog, cfg: ModelConfig, exclude_seen: bool
) -> dict:
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
