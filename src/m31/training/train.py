"""Training of the retrieval models and the ranking model.

Shapes: B requests in a batch, U uniform negatives, C candidates, A ads, E experts.

Retrieval models train with a sampled softmax over in-batch and uniform negatives with logQ
correction (a candidate's logit minus the log-probability that sampling put it in the set),
plus the gate's load-balancing term; with `loss="full"`, the softmax over every ad of the
catalogue instead (cross-entropy, nothing sampled, so no correction); or, with `loss="bce"`,
SASRec's binary cross-entropy of each target against one uniformly drawn negative
(`bce_loss`). The ranking model trains the same way, but scores each request against its own
small candidate set (its positive, other requests' positives, uniform negatives), since every
(request, ad) pair costs it a full forward pass; so does the dense interaction model. Such negatives are easy; where the ranking
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
from types import SimpleNamespace

import numpy as np
import torch
import torch.nn.functional as F

from m31.data.dataset import repeat_engagement
from m31.eval import evaluate
from m31.features import Features
from m31.model.checkpoint import build_model, vocab_sizes
from m31.model.config import ModelConfig
from m31.model.inference import ScoreFunction
from m31.model.inputs import Catalog, RequestInputs, make_requests
from m31.model.retrieval import (
    RetrievalModel,
    balance_loss,
    expert_usage,
    sampled_softmax_loss,
)
from m31.ops import score

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
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
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
    if (cfg.ranking_base is not None) != (base is not None):
        raise ValueError("a ranking model's base needs both cfg.ranking_base and the base model")
    if base is not None:
        if base.cfg.to_dict() != cfg.ranking_base:
            raise ValueError("the base model's config is not cfg.ranking_base")
        model.base.load_state_dict(base.state_dict())
    trainable = [p for p in model.parameters() if p.requires_grad]
    # fused: one pass over each tensor, the same update (DESIGN §3)
    opt = torch.optim.AdamW(trainable, lr=cfg.lr, weight_decay=cfg.weight_decay, fused=True)
    train_split = feats.splits["train"]
    n, n_ads = len(train_split["user"]), feats.n_ads
    if n == 0:
        raise ValueError("the train split is empty")
    exclude_seen = (
        not repeat_engagement(feats.meta) if cfg.val_exclude_seen is None else cfg.val_exclude_seen
    )
    pop = np.bincount(train_split["item"], minlength=n_ads) / n  # in-batch sampling probability
    hard = None  # [n, pool] the hard negatives' pool of each example
    if (cfg.ranking_hard > 0) != (retriever is not None):
        raise ValueError("hard negatives need both cfg.ranking_hard > 0 and a retriever")
    if retriever is not None:
        start = time.perf_counter()
        hard = hard_negative_pool(retriever, feats, cfg.ranking_hard_pool)
        log(
            f"hard negatives: {cfg.ranking_hard} per request from the retriever's top "
            f"{cfg.ranking_hard_pool} ({time.perf_counter() - start:.0f} s)"
        )
    examples = _anchors(train_split, cfg.max_len) if cfg.trains_every_position else np.arange(n)
    steps = math.ceil(len(examples) / cfg.batch_size)
    metric = cfg.val_metric
    history: list[dict] = []
    best, best_state, bad_epochs, first = -1.0, None, 0, 0
    if resume is not None:
        first, best, best_state, bad_epochs, history = _restore(resume, cfg, model, opt, rng)
    bar = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[note]}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        disable=not progress,
        transient=True,
    )

    def validate(title: str) -> dict:
        """`_validate` with its own line on the progress bar: over a large catalogue, every
        validation request's full ranking can take longer than the epoch's training."""
        task = bar.add_task(f"{cfg.kind} {title}: validation", total=None, note="")
        val = _validate(
            model, feats, catalog, cfg, exclude_seen,
            progress=lambda _, done, total: bar.update(task, completed=done, total=total),
        )  # fmt: skip
        bar.remove_task(task)
        return val

    with bar:
        if base is not None and resume is None:  # epoch 0: the base's order, the one to beat
            model.eval()
            val = validate("epoch 0")
            history.append({"epoch": 0, "loss": None, **{f"val_{k}": v for k, v in val.items()}})
            log(f"epoch 0 (the base alone): val HR@10 {val['hr@10']:.4f}, HR@50 {val['hr@50']:.4f}")
            best, best_state = val[metric], copy.deepcopy(model.state_dict())
        for epoch in range(first, cfg.epochs):
            if bad_epochs >= cfg.patience:  # a resumed training that had stopped early
                break
            task = bar.add_task(f"{cfg.kind} epoch {epoch + 1}/{cfg.epochs}", total=steps, note="")
            model.train()
            start, losses, gates = time.perf_counter(), [], []
            perm = rng.permutation(examples)
            for step in range(steps):
                rows = perm[step * cfg.batch_size : (step + 1) * cfg.batch_size]
                r = requests_for(feats, train_split, rows, cfg.max_len).to(device)
                pos = torch.from_numpy(train_split["item"][rows]).to(device)
                if cfg.kind in ("ranking", "dense"):  # pair models: per-request candidates
                    hard_ads = None if hard is None else _draw(hard[rows], cfg.ranking_hard, rng)
                    loss = _ranking_step(
                        model, r, catalog, pos, pop, n_ads, cfg, rng, device, hard_ads
                    )
                elif cfg.trains_every_position:
                    _, _, hist_ts, _ = feats.history(
                        train_split["user"][rows], train_split["ts"][rows], cfg.max_len
                    )
                    loss, gate = _position_step(
                        model, r, catalog, pos, hist_ts, pop, n_ads, cfg, rng, device
                    )
                else:
                    loss, gate = _retrieval_step(
                        model, r, catalog, pos, pop, n_ads, cfg, rng, device
                    )
                    if cfg.kind == "moe" and step % 20 == 0:
                        gates.append(gate.detach().mean((0, 1)))
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(trainable, 5.0)
                opt.step()
                losses.append(float(loss.detach()))
                bar.update(task, advance=1, note=f"loss {np.mean(losses[-50:]):.3f}")
            bar.remove_task(task)
            val = validate(f"epoch {epoch + 1}")
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
                f"HR@50 {val['hr@50']:.4f}"
                + (f", {metric} {val[metric]:.4f}" if metric not in ("hr@10", "hr@50") else "")
                + f" ({entry['seconds']:.0f} s)"
                + (f", expert evenness {entry['experts']['evenness']:.3f}" if gates else "")
            )
            if val[metric] > best:
                best, best_state, bad_epochs = val[metric], copy.deepcopy(model.state_dict()), 0
                if on_best is not None:
                    on_best(model, history)
            else:
                bad_epochs += 1
            if on_epoch is not None:
                on_epoch({
                    "config": cfg.to_dict(), "epoch": epoch + 1, "history": history,
                    "model": model.state_dict(), "optimizer": opt.state_dict(),
                    "best": best, "best_state": best_state, "bad_epochs": bad_epochs,
                    "numpy_rng": rng.bit_generator.state, "torch_rng": torch.get_rng_state(),
                    "cuda_rng": torch.cuda.get_rng_state_all() if device.type == "cuda" else None,
                })  # fmt: skip
            if bad_epochs >= cfg.patience:
                log(f"early stop: no validation gain for {cfg.patience} epochs")
                break
    model.load_state_dict(best_state)
    model.eval()
    return model, history


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


def bce_loss(pos: torch.Tensor, neg: torch.Tensor) -> torch.Tensor:
    """SASRec's loss: −log σ(s⁺) − log(1 − σ(s⁻)) of each target's score and its one negative's,
    both [P], averaged over the P targets."""
    return (F.softplus(-pos) + F.softplus(neg)).mean()


def _with_balance(loss: torch.Tensor, gate: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """`loss` plus the moe gate's specialisation term (`balance_loss`), if it has one."""
    if cfg.kind == "moe" and cfg.balance_weight > 0:
        return loss + cfg.balance_weight * balance_loss(gate)
    return loss


def _retrieval_step(model, r, catalog, pos, pop, n_ads, cfg, rng, device):
    b = len(pos)
    if cfg.loss == "bce":  # each request's positive against one uniform negative, its own ads
        neg = torch.from_numpy(rng.integers(0, n_ads, b)).to(device)
        scores, gate = model(r, catalog, catalog.take(torch.stack([pos, neg], dim=1)))  # [B, 2]
        return _with_balance(bce_loss(scores[:, 0], scores[:, 1]), gate, cfg), gate
    if cfg.loss == "full":
        scores, gate = model(r, catalog, catalog)  # [B, A], [B, A, E]
        return _with_balance(F.cross_entropy(scores, pos), gate, cfg), gate
    neg = torch.from_numpy(rng.integers(0, n_ads, cfg.uniform_negatives)).to(device)
    cand = torch.cat([pos, neg])  # [C] in-batch positives, then uniform negatives
    # Probability that a candidate was drawn into the set: by popularity in-batch, or uniformly.
    q = b * torch.from_numpy(pop).to(device)[cand] + cfg.uniform_negatives / n_ads
    scores, gate = model(r, catalog, catalog.take(cand))  # [B, C], [B, C, E]
    loss = sampled_softmax_loss(scores, q.log(), torch.arange(b, device=device), cand, pos)
    return _with_balance(loss, gate, cfg), gate


def _anchors(split: dict[str, np.ndarray], every: int) -> np.ndarray:
    """Rows of the anchor examples of training with a target at every position: each user's
    last train example (by time) and every `every`-th before it."""
    order = np.lexsort((split["ts"], split["user"]))  # each user's examples in time order
    user = split["user"][order]
    starts = np.r_[0, np.flatnonzero(user[1:] != user[:-1]) + 1]  # each user's run
    ends = np.r_[starts[1:], len(user)]
    from_end = np.repeat(ends, ends - starts) - 1 - np.arange(len(user))  # 0: the user's last
    return np.sort(order[from_end % every == 0])


def _position_step(model, r, catalog, pos, hist_ts, pop, n_ads, cfg, rng, device):
    """The loss with a target at every position: the request's query against the anchors'
    ads (in-batch) and uniform negatives, as `_retrieval_step`; the query after each history
    position against the next engagement and the same candidates (module docstring).
    hist_ts [B, L] the history's times."""
    b = len(pos)
    if cfg.loss == "bce":
        return _position_step_bce(model, r, catalog, pos, hist_ts, n_ads, cfg, rng, device)
    if cfg.loss == "full":
        return _position_step_full(model, r, catalog, pos, hist_ts, cfg, device)
    neg = torch.from_numpy(rng.integers(0, n_ads, cfg.uniform_negatives)).to(device)
    cand = torch.cat([pos, neg])  # [C]
    pop_t = torch.from_numpy(pop).to(device)
    log_q = (b * pop_t[cand] + cfg.uniform_negatives / n_ads).log()  # [C]
    (qf, vf, pf), (q, v, p) = model.encode_positions(r, catalog)
    g, x, bias = model.encode_ads(catalog.take(cand))  # [C, G], [C, D], [C]
    scores, gate = score(qf, vf, pf, g, x, bias, return_gate=True)  # [B, C], [B, C, E]
    final = sampled_softmax_loss(scores, log_q, torch.arange(b, device=device), cand, pos)
    has, target = _next_targets(r, hist_ts, device)  # [B, L-1], [P]
    loss = final
    if len(target):
        qp, vp, pp = q[:, :-1][has], v[:, :-1][has], p[:, :-1][has]  # [P, E', G] ...
        gt, xt, bt = model.encode_ads(catalog.take(target))  # [P, G], [P, D], [P]
        own = score(qp, vp, pp, gt[:, None], xt[:, None], bt[:, None])  # [P, 1]
        shared = score(qp, vp, pp, g, x, bias)  # [P, C]
        own_q = (b * pop_t[target] + cfg.uniform_negatives / n_ads).log()  # [P]
        at = sampled_softmax_loss(
            torch.cat([own, shared], dim=1),
            torch.cat([own_q[:, None], log_q.expand(len(target), -1)], dim=1),
            torch.zeros(len(target), dtype=torch.long, device=device),
            torch.cat([target[:, None], cand.expand(len(target), -1)], dim=1),
            target,
        )
        loss = (final * b + at * len(target)) / (b + len(target))
    return _with_balance(loss, gate, cfg), gate


def _next_targets(r, hist_ts, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(has [B, L-1]: the history positions with a target, target [P]: the engagement after
    each): a position's next engagement, unless padding or in the same second."""
    items = r.hist_item  # [B, L]
    ts = torch.from_numpy(hist_ts).to(device)
    nxt = items[:, 1:]
    has = (items[:, :-1] >= 0) & (nxt >= 0) & (ts[:, 1:] > ts[:, :-1])  # [B, L-1]
    return has, nxt[has]


def _position_step_full(model, r, catalog, pos, hist_ts, cfg, device):
    """`_position_step` with the full softmax: the request's query and the query after each
    history position, each scoring every ad of the catalogue, cross-entropy of its target."""
    (qf, vf, pf), (q, v, p) = model.encode_positions(r, catalog)
    g, x, bias = model.encode_ads(catalog)  # [A, G], [A, D], [A]
    scores, gate = _every_item(qf, vf, pf, g, x, bias)  # [B, A], [B, A or 1, E]
    has, target = _next_targets(r, hist_ts, device)  # [B, L-1], [P]
    loss = F.cross_entropy(scores, pos, reduction="sum")
    if len(target):
        at, _ = _every_item(q[:, :-1][has], v[:, :-1][has], p[:, :-1][has], g, x, bias)  # [P, A]
        loss = loss + F.cross_entropy(at, target, reduction="sum")
    return _with_balance(loss / (len(pos) + len(target)), gate, cfg), gate


def _every_item(q, v, p, g, x, bias):
    """(scores [n, A] of queries q [n, E, G], v [n, E, D], p [n, E] against every ad, the gate
    [n, A, E]). Without gate keys (G = 0) every ad gets the same expert weights softmax(p), so
    the score is one dot product with the weighted value (as the engine folds it,
    `m31.engine.retriever.fold`): one matrix product instead of E of them and a softmax over
    [n, A, E], the same value and gradient; the gate is then [n, 1, E], which the balance term
    reads as it reads every ad's copy of it."""
    if q.shape[-1]:
        return score(q, v, p, g, x, bias, return_gate=True)
    w = torch.softmax(p.float(), dim=1)  # [n, E]
    folded = (w[:, :, None] * v.float()).sum(1)  # [n, D]
    return folded @ x.float().T + bias.float(), w[:, None, :]


def _position_step_bce(model, r, catalog, pos, hist_ts, n_ads, cfg, rng, device):
    """`_position_step` with SASRec's loss: the request's query and the query after each
    history position, each scoring its target against one uniformly drawn negative."""
    (qf, vf, pf), (q, v, p) = model.encode_positions(r, catalog)
    has, target = _next_targets(r, hist_ts, device)  # [B, L-1], [P]

    def pairs(targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(g [n, 2, G], x [n, 2, D], b [n, 2]): each target ad [n], then one uniform negative."""
        negatives = torch.from_numpy(rng.integers(0, n_ads, len(targets))).to(device)
        return model.encode_ads(catalog.take(torch.stack([targets, negatives], dim=1)))

    # The request's query (every slot) and each position's (E' slots): two score calls.
    final, gate = score(qf, vf, pf, *pairs(pos), return_gate=True)  # [B, 2]
    scores = [final]
    if len(target):
        scores.append(score(q[:, :-1][has], v[:, :-1][has], p[:, :-1][has], *pairs(target)))
    pair = torch.cat(scores)  # [B + P, 2]
    return _with_balance(bce_loss(pair[:, 0], pair[:, 1]), gate, cfg), gate


def _draw(pool: np.ndarray, count: int, rng: np.random.Generator) -> np.ndarray:
    """[B, count]: from each row of pool [B, P], `count` ads drawn uniformly (with replacement)."""
    pick = rng.integers(0, pool.shape[1], (len(pool), count))
    return np.take_along_axis(pool, pick, axis=1)


def _ranking_step(model, r, catalog, pos, pop, n_ads, cfg, rng, device, hard=None):
    """The ranking model's loss on candidates [B, C]: the positive, in-batch and uniform
    negatives, and `hard` [B, H] (drawn from each request's pool of P ads) if given."""
    b = len(pos)
    k = min(cfg.ranking_in_batch, b - 1)
    shifts = torch.arange(1, k + 1, device=device)
    in_batch = pos[(torch.arange(b, device=device)[:, None] + shifts[None, :]) % b]  # [B, k]
    uniform = torch.from_numpy(rng.integers(0, n_ads, (b, cfg.ranking_negatives))).to(device)
    parts = [pos[:, None], in_batch, uniform]
    if hard is not None:
        parts.append(torch.from_numpy(hard).to(device, torch.long))
    cand = torch.cat(parts, dim=1)  # [B, C]
    # expected count of each candidate in the set: in-batch (popularity), uniform, and for the
    # hard columns their draw from the pool (an ad's chance to be in the pool otherwise ignored)
    q = k * torch.from_numpy(pop).to(device)[cand] + cfg.ranking_negatives / n_ads
    if hard is not None:
        q[:, -hard.shape[1] :] += hard.shape[1] / cfg.ranking_hard_pool
    scores = model(r, catalog, cand)
    return sampled_softmax_loss(
        scores, q.log(), torch.zeros(b, dtype=torch.long, device=device), cand, pos
    )
