"""Training of the retrieval models and the ranking model.

Shapes: B requests in a batch, U uniform negatives, C candidates, A ads, E experts.

Retrieval models train with a sampled softmax over in-batch and uniform negatives with logQ
correction (a candidate's logit minus the log-probability that sampling put it in the set),
plus the gate's load-balancing term; with `loss="full"`, the softmax over every ad of the
catalogue instead (cross-entropy, nothing sampled, so no correction); or, with `loss="bce"`,
SASRec's binary cross-entropy of each target against one uniformly drawn negative (each batch's
loss: `m31.training.losses`). The ranking model trains the same way, but scores each request
against its own small candidate set (its positive, other requests' positives, uniform
negatives), since every (request, ad) pair costs it a full forward pass; so does the dense
interaction model. Such negatives are easy; where the ranking
model re-ranks a retrieval model's top candidates it meets hard ones, so it can also draw
`ranking_hard` negatives per request from that model's top `ranking_hard_pool` ads for the
request (`hard_negative_pool`, computed once before training).
A ranking model with a base (`ModelConfig.ranking_base`) takes the base's weights from the
trained retrieval model given, validates by re-ranking the base's top `ranking_hard_pool` ads,
and its validation before the first epoch (the base's order) is the one to beat.
Early stopping reads the validation split through `m31.eval` (`cfg.val_metric` on
`cfg.val_requests` requests; a protocol, `m31.eval.protocol`, sets them), which is why training
lives outside `m31.model`.

A target at every position (`ModelConfig.trains_every_position`, the causal sequence expert):
a batch is a set of *anchor* examples, each user's last train example and every `max_len`-th
before it, so that each train engagement is a target once per epoch. The request's query scores
the anchor's ad, as above; the query after each history position i (`encode_positions`: the
families that read nothing after i) scores engagement i + 1 against its own ad and the same
shared candidates, with the same logQ correction. A position whose next engagement falls in the
same second has no target: a request knows only what happened strictly before it.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from m31.data.dataset import repeat_engagement
from m31.eval import evaluate
from m31.features import Features
from m31.model.checkpoint import build_model, vocab_sizes
from m31.model.config import ModelConfig
from m31.model.inference import ScoreFunction
from m31.model.inputs import Catalog, RequestInputs, make_requests
from m31.model.retrieval import RetrievalModel, expert_usage
from m31.training.losses import draw, position_loss, ranking_loss, retrieval_loss

Log = Callable[[str], None]


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def requests_for(
    feats: Features, split: dict[str, np.ndarray], rows: np.ndarray, max_len: int
) -> RequestInputs:
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
    model, feats: Features, catalog: Catalog, cfg: ModelConfig, exclude_seen: bool, progress=None
) -> dict:
    """HR@10, HR@50 and `cfg.val_metric` on `cfg.val_requests` validation requests (0: all),
    the user's engaged ads excluded if `exclude_seen`: over the whole corpus, or for a ranking
    model with a base, over the base's top `cfg.ranking_hard_pool` ads it re-ranks (where it is
    used; also a small fraction of the pairs of the whole corpus). `progress`: as `evaluate`'s."""
    fn = ScoreFunction(model, feats, catalog)
    base = getattr(model, "base", None)
    if base is None:
        fns, rerank = {"model": fn}, None
    else:
        fns = {"base": ScoreFunction(base, feats, catalog)}
        rerank = {"model": ("base", fn.rank, cfg.ranking_hard_pool)}
    res = evaluate(
        fns,
        feats,
        split="val",
        ks=tuple(sorted({10, 50, cfg.val_k})),
        max_users=cfg.val_requests or None,
        exclude_seen=exclude_seen,
        rerank=rerank,
        progress=progress,
    )
    return res["model"]


def hard_negative_pool(
    retriever: ScoreFunction, feats: Features, pool: int, batch: int = 256
) -> np.ndarray:
    """[n, pool] int32: for each of the n examples of the train split, the `pool` ads that
    `retriever` (a trained model over the same features) scores highest for the example's
    request, the user's own training ads left out: they are positives elsewhere in the log, not
    negatives. Raises ValueError if some user leaves fewer than `pool` other ads."""
    split = feats.splits["train"]
    n, n_ads = len(split["user"]), feats.n_ads
    users, items = split["user"], split["item"]
    order = np.argsort(users, kind="stable")
    by_user, starts = np.unique(users[order], return_index=True)
    counts = np.diff(np.append(starts, len(order)))
    most = int(counts.max()) if len(counts) else 0
    if pool < 1 or pool > n_ads - most:
        raise ValueError(
            f"a hard-negative pool of {pool} ads: need 1 <= pool <= {n_ads - most} (the {n_ads} "
            f"ads less the {most} of the user with the most training ads)"
        )
    out = np.empty((n, pool), dtype=np.int32)  # ad rows (2 M examples x 500: 4 GB as int64)
    for lo in range(0, n, batch):
        rows = np.arange(lo, min(lo + batch, n))
        req = SimpleNamespace(
            **{k: split[k][rows] for k in ("user", "ts", "surface", "hour", "platform")}
        )
        scores = np.asarray(retriever(req), dtype=np.float32)  # [b, A]
        at = np.searchsorted(by_user, users[rows])  # each row's user in by_user
        n_seen = counts[at]
        first = np.repeat(starts[at], n_seen)  # [S] the user's first entry in `order`
        offset = np.arange(n_seen.sum()) - np.repeat(np.cumsum(n_seen) - n_seen, n_seen)
        scores[np.repeat(np.arange(len(rows)), n_seen), items[order[first + offset]]] = -np.inf
        out[rows] = np.argpartition(-scores, pool - 1, axis=1)[:, :pool]
    return out


def train(
    cfg: ModelConfig,
    feats: Features,
    device: torch.device | str | None = None,
    log: Log = print,
    progress: bool = True,
    retriever: ScoreFunction | None = None,
    base: RetrievalModel | None = None,
    on_best: Callable[[torch.nn.Module, list[dict]], None] | None = None,
    on_epoch: Callable[[dict], None] | None = None,
    resume: dict | None = None,
):
    """Train a model on `feats` (train split; early stopping on the val split's
    `cfg.val_metric`).

    `retriever`: for a ranking model with `cfg.ranking_hard` > 0, the trained retrieval model
    whose top `cfg.ranking_hard_pool` ads per request the hard negatives come from.
    `base`: for a ranking model with `cfg.ranking_base`, the trained retrieval model (of that
    config) whose score it corrects.
    `on_best(model, history)`: called after every epoch that improves on the best so far, with
    the model in that state (e.g. to write a checkpoint a long run can be stopped at).
    `on_epoch(state)`: called after every epoch with all a stopped training needs to go on: the
    weights, the optimizer's and the random generators' states, the best epoch's weights, the
    history. `resume`: such a state, of a training of this config (its epochs and patience may
    differ: a run can be given more) on these features; training goes on after its epoch and
    ends as it would have had it never stopped.
    Returns (model, history) where history holds per-epoch loss, validation metrics, time, and
    for the MoE the experts' usage; for a ranking model with a base it starts with epoch 0, the
    base alone (loss None).
    """
    device = torch.device(device) if device is not None else default_device()
    torch.manual_seed(cfg.seed)
    rng = np.random.default_rng(cfg.seed)
    run = _start(cfg, feats, device, rng, retriever, base, log, progress)
    split = feats.splits["train"]
    n = len(split["user"])
    examples = _anchors(split, cfg.max_len) if cfg.trains_every_position else np.arange(n)
    metric = cfg.val_metric
    history: list[dict] = []
    best, best_state, bad_epochs, first = -1.0, None, 0, 0
    if resume is not None:
        first, best, best_state, bad_epochs, history = _restore(
            resume, cfg, run.model, run.opt, run.rng
        )
    with run.bar:
        if base is not None and resume is None:  # epoch 0: the base's order, the one to beat
            run.model.eval()
            val = run.validate("epoch 0")
            history.append({"epoch": 0, "loss": None, **{f"val_{k}": v for k, v in val.items()}})
            log(f"epoch 0 (the base alone): val HR@10 {val['hr@10']:.4f}, HR@50 {val['hr@50']:.4f}")
            best, best_state = val[metric], copy.deepcopy(run.model.state_dict())
        for epoch in range(first, cfg.epochs):
            if bad_epochs >= cfg.patience:  # a resumed training that had stopped early
                break
            entry = _epoch(run, examples, epoch)
            history.append(entry)
            log(_epoch_line(entry, metric))
            if entry[f"val_{metric}"] > best:
                best, best_state, bad_epochs = entry[f"val_{metric}"], run.weights(), 0
                if on_best is not None:
                    on_best(run.model, history)
            else:
                bad_epochs += 1
            if on_epoch is not None:
                on_epoch(run.state(epoch + 1, history, best, best_state, bad_epochs))
            if bad_epochs >= cfg.patience:
                log(f"early stop: no validation gain for {cfg.patience} epochs")
                break
    run.model.load_state_dict(best_state)
    run.model.eval()
    return run.model, history


@dataclass
class _Run:
    """What one training holds while it runs: the model and its optimizer, the generator its
    negatives and batches are drawn from, the in-batch sampling probabilities `pop` [A], the
    hard negatives' pool of each example (or None) and the progress bar."""

    cfg: ModelConfig
    feats: Features
    device: torch.device
    catalog: Catalog
    model: torch.nn.Module
    opt: torch.optim.Optimizer
    rng: np.random.Generator
    pop: np.ndarray
    hard: np.ndarray | None
    exclude_seen: bool
    bar: Any

    def weights(self) -> dict:
        return copy.deepcopy(self.model.state_dict())

    def validate(self, title: str) -> dict:
        """`_validate` with its own line on the progress bar: over a large catalogue, every
        validation request's full ranking can take longer than the epoch's training."""
        task = self.bar.add_task(f"{self.cfg.kind} {title}: validation", total=None, note="")
        val = _validate(
            self.model,
            self.feats,
            self.catalog,
            self.cfg,
            self.exclude_seen,
            progress=lambda _, done, total: self.bar.update(task, completed=done, total=total),
        )
        self.bar.remove_task(task)
        return val

    def state(self, epoch: int, history, best, best_state, bad_epochs) -> dict:
        """All a stopped training needs to go on after `epoch` (`train`'s `on_epoch`)."""
        cuda = self.device.type == "cuda"
        return {
            "config": self.cfg.to_dict(),
            "epoch": epoch,
            "history": history,
            "model": self.model.state_dict(),
            "optimizer": self.opt.state_dict(),
            "best": best,
            "best_state": best_state,
            "bad_epochs": bad_epochs,
            "numpy_rng": self.rng.bit_generator.state,
            "torch_rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state_all() if cuda else None,
        }


def _start(cfg, feats, device, rng, retriever, base, log: Log, progress: bool) -> _Run:
    """The model (with its base's weights), its optimizer and what its batches draw from."""
    catalog = Catalog.from_features(feats).to(device)
    model = build_model(
        cfg, vocab_sizes(feats), feats.text_emb.shape[1], feats.cooc_emb.shape[1]
    ).to(device)
    if (cfg.ranking_base is not None) != (base is not None):
        raise ValueError("a ranking model's base needs both cfg.ranking_base and the base model")
    if base is not None:
        if base.cfg.to_dict() != cfg.ranking_base:
            raise ValueError("the base model's config is not cfg.ranking_base")
        model.base.load_state_dict(base.state_dict())
    trainable = [p for p in model.parameters() if p.requires_grad]
    # fused: one pass over each tensor, the same update (DESIGN §3)
    opt = torch.optim.AdamW(trainable, lr=cfg.lr, weight_decay=cfg.weight_decay, fused=True)
    split = feats.splits["train"]
    n = len(split["user"])
    if n == 0:
        raise ValueError("the train split is empty")
    exclude_seen = (
        not repeat_engagement(feats.meta) if cfg.val_exclude_seen is None else cfg.val_exclude_seen
    )
    pop = np.bincount(split["item"], minlength=feats.n_ads) / n  # in-batch sampling probability
    if (cfg.ranking_hard > 0) != (retriever is not None):
        raise ValueError("hard negatives need both cfg.ranking_hard > 0 and a retriever")
    hard = None  # [n, pool] the hard negatives' pool of each example
    if retriever is not None:
        start = time.perf_counter()
        hard = hard_negative_pool(retriever, feats, cfg.ranking_hard_pool)
        log(
            f"hard negatives: {cfg.ranking_hard} per request from the retriever's top "
            f"{cfg.ranking_hard_pool} ({time.perf_counter() - start:.0f} s)"
        )
    return _Run(
        cfg, feats, device, catalog, model, opt, rng, pop, hard, exclude_seen, _bar(progress)
    )


def _bar(progress: bool):
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[note]}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        disable=not progress,
        transient=True,
    )


def _epoch(run: _Run, examples: np.ndarray, epoch: int) -> dict:
    """One epoch: a step per batch of `examples` in a fresh order, then the validation; its
    history entry."""
    cfg = run.cfg
    steps = math.ceil(len(examples) / cfg.batch_size)
    task = run.bar.add_task(f"{cfg.kind} epoch {epoch + 1}/{cfg.epochs}", total=steps, note="")
    run.model.train()
    start, losses, gates = time.perf_counter(), [], []
    perm = run.rng.permutation(examples)
    trainable = [p for group in run.opt.param_groups for p in group["params"]]
    for step in range(steps):
        rows = perm[step * cfg.batch_size : (step + 1) * cfg.batch_size]
        loss, gate = _loss(run, rows)
        if gate is not None and cfg.kind == "moe" and step % 20 == 0:
            gates.append(gate.detach().mean((0, 1)))
        run.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 5.0)
        run.opt.step()
        losses.append(float(loss.detach()))
        run.bar.update(task, advance=1, note=f"loss {np.mean(losses[-50:]):.3f}")
    run.bar.remove_task(task)
    val = run.validate(f"epoch {epoch + 1}")
    entry = {
        "epoch": epoch + 1,
        "loss": float(np.mean(losses)),
        "seconds": round(time.perf_counter() - start, 1),
        **{f"val_{k}": v for k, v in val.items()},
    }
    if gates:
        entry["experts"] = expert_usage(torch.stack(gates)[:, None, :])
    return entry


def _loss(run: _Run, rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(loss, the gate or None) of the batch of train examples `rows`, by the model's kind."""
    cfg, feats, device, rng = run.cfg, run.feats, run.device, run.rng
    split = feats.splits["train"]
    r = requests_for(feats, split, rows, cfg.max_len).to(device)
    pos = torch.from_numpy(split["item"][rows]).to(device)
    n_ads = feats.n_ads
    if cfg.kind in ("ranking", "dense"):  # pair models: per-request candidates
        hard = None if run.hard is None else draw(run.hard[rows], cfg.ranking_hard, rng)
        loss = ranking_loss(run.model, r, run.catalog, pos, run.pop, n_ads, cfg, rng, device, hard)
        return loss, None
    if cfg.trains_every_position:
        _, _, hist_ts, _ = feats.history(split["user"][rows], split["ts"][rows], cfg.max_len)
        args = (run.model, r, run.catalog, pos, hist_ts, run.pop, n_ads, cfg, rng, device)
        loss, _ = position_loss(*args)
        return loss, None  # the expert usage is read at the request's query only
    return retrieval_loss(run.model, r, run.catalog, pos, run.pop, n_ads, cfg, rng, device)


def _epoch_line(entry: dict, metric: str) -> str:
    """The log line of an epoch's history entry."""
    line = (
        f"epoch {entry['epoch']}: loss {entry['loss']:.4f}, val HR@10 {entry['val_hr@10']:.4f}, "
        f"HR@50 {entry['val_hr@50']:.4f}"
    )
    if metric not in ("hr@10", "hr@50"):
        line += f", {metric} {entry[f'val_{metric}']:.4f}"
    line += f" ({entry['seconds']:.0f} s)"
    if "experts" in entry:
        line += f", expert evenness {entry['experts']['evenness']:.3f}"
    return line


def _restore(state: dict, cfg: ModelConfig, model, opt, rng: np.random.Generator):
    """Load an `on_epoch` state into the model, the optimizer and the random generators; (the
    next epoch's index, best metric, best weights, epochs without gain, history). Raises
    ValueError if it is of another config (epochs and patience aside)."""
    mine, theirs = cfg.to_dict(), dict(state["config"])
    for key in ("epochs", "patience"):
        mine.pop(key, None)
        theirs.pop(key, None)
    if mine != theirs:
        differ = sorted(k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k))
        raise ValueError(f"the stopped training had another config ({', '.join(differ)})")
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    rng.bit_generator.state = state["numpy_rng"]
    torch.set_rng_state(state["torch_rng"].cpu())
    if state["cuda_rng"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda_rng"]])
    history = list(state["history"])
    return state["epoch"], state["best"], state["best_state"], state["bad_epochs"], history


def _anchors(split: dict[str, np.ndarray], every: int) -> np.ndarray:
    """Rows of the anchor examples of training with a target at every position: each user's
    last train example (by time) and every `every`-th before it."""
    order = np.lexsort((split["ts"], split["user"]))  # each user's examples in time order
    user = split["user"][order]
    starts = np.r_[0, np.flatnonzero(user[1:] != user[:-1]) + 1]  # each user's run
    ends = np.r_[starts[1:], len(user)]
    from_end = np.repeat(ends, ends - starts) - 1 - np.arange(len(user))  # 0: the user's last
    return np.sort(order[from_end % every == 0])
