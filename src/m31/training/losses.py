"""The losses of one training batch (`m31.training.train`): the retrieval models' sampled
softmax with logQ correction, the full softmax, or SASRec's binary cross-entropy, at the
request's query or at every position of the history; and the pair models' softmax over each
request's own candidates.

Shapes: B requests in a batch, C candidates, A ads, E experts, L history length, P positions
with a target.

Each loss function takes the model, the batch's request inputs `r`, the catalogue, the
positives `pos` [B] (catalogue rows), the in-batch sampling probabilities `pop` [A], the
catalogue size, the config, the numpy generator its negatives are drawn from, and the device;
it returns the loss (plus the gate for the retrieval models, which the balance term and the
expert usage read).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from m31.model.config import ModelConfig
from m31.model.retrieval import balance_loss, sampled_softmax_loss
from m31.ops import score


def bce_loss(pos: torch.Tensor, neg: torch.Tensor) -> torch.Tensor:
    """SASRec's loss: −log σ(s⁺) − log(1 − σ(s⁻)) of each target's score and its one negative's,
    both [P], averaged over the P targets."""
    return (F.softplus(-pos) + F.softplus(neg)).mean()


def _with_balance(loss: torch.Tensor, gate: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """`loss` plus the moe gate's specialisation term (`balance_loss`), if it has one."""
    if cfg.kind == "moe" and cfg.balance_weight > 0:
        return loss + cfg.balance_weight * balance_loss(gate)
    return loss


def retrieval_loss(model, r, catalog, pos, pop, n_ads, cfg, rng, device):
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


def position_loss(model, r, catalog, pos, hist_ts, pop, n_ads, cfg, rng, device):
    """The loss with a target at every position: the request's query against the anchors'
    ads (in-batch) and uniform negatives, as `retrieval_loss`; the query after each history
    position against the next engagement and the same candidates (module docstring).
    hist_ts [B, L] the history's times."""
    b = len(pos)
    if cfg.loss == "bce":
        return _position_loss_bce(model, r, catalog, pos, hist_ts, n_ads, cfg, rng, device)
    if cfg.loss == "full":
        return _position_loss_full(model, r, catalog, pos, hist_ts, cfg, device)
    neg = torch.from_numpy(rng.integers(0, n_ads, cfg.uniform_negatives)).to(device)
    cand = torch.cat([pos, neg])  # [C]
    pop_t = torch.from_numpy(pop).to(device)
    log_q = (b * pop_t[cand] + cfg.uniform_negatives / n_ads).log()  # [C]
    (qf, vf, pf), (q, v, p) = model.encode_positions(r, catalog)
    g, x, bias = model.encode_ads(catalog.take(cand))  # [C, G], [C, D], [C]
    scores, gate = score(qf, vf, pf, g, x, bias, return_gate=True)  # [B, C], [B, C, E]
    final = sampled_softmax_loss(scores, log_q, torch.arange(b, device=device), cand, pos)
    has, target = next_targets(r, hist_ts, device)  # [B, L-1], [P]
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


def next_targets(r, hist_ts, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(has [B, L-1]: the history positions with a target, target [P]: the engagement after
    each): a position's next engagement, unless padding or in the same second."""
    items = r.hist_item  # [B, L]
    ts = torch.from_numpy(hist_ts).to(device)
    nxt = items[:, 1:]
    has = (items[:, :-1] >= 0) & (nxt >= 0) & (ts[:, 1:] > ts[:, :-1])  # [B, L-1]
    return has, nxt[has]


def _position_loss_full(model, r, catalog, pos, hist_ts, cfg, device):
    """`position_loss` with the full softmax: the request's query and the query after each
    history position, each scoring every ad of the catalogue, cross-entropy of its target."""
    (qf, vf, pf), (q, v, p) = model.encode_positions(r, catalog)
    g, x, bias = model.encode_ads(catalog)  # [A, G], [A, D], [A]
    scores, gate = every_item(qf, vf, pf, g, x, bias)  # [B, A], [B, A or 1, E]
    has, target = next_targets(r, hist_ts, device)  # [B, L-1], [P]
    loss = F.cross_entropy(scores, pos, reduction="sum")
    if len(target):
        at, _ = every_item(q[:, :-1][has], v[:, :-1][has], p[:, :-1][has], g, x, bias)  # [P, A]
        loss = loss + F.cross_entropy(at, target, reduction="sum")
    return _with_balance(loss / (len(pos) + len(target)), gate, cfg), gate


def every_item(q, v, p, g, x, bias):
    """(scores [n, A] of queries q [n, E, G], v [n, E, D], p [n, E] against every ad, the gate
    [n, A, E]). Without gate keys (G = 0) every ad gets the same expert weights softmax(p), so
    the score is one dot product with the weighted value (as the engine folds it,
    `m31.engine.search.fold`): one matrix product instead of E of them and a softmax over
    [n, A, E], the same value and gradient; the gate is then [n, 1, E], which the balance term
    reads as it reads every ad's copy of it."""
    if q.shape[-1]:
        return score(q, v, p, g, x, bias, return_gate=True)
    w = torch.softmax(p.float(), dim=1)  # [n, E]
    folded = (w[:, :, None] * v.float()).sum(1)  # [n, D]
    return torch.addmm(bias.float(), folded, x.float().T), w[:, None, :]


def _position_loss_bce(model, r, catalog, pos, hist_ts, n_ads, cfg, rng, device):
    """`position_loss` with SASRec's loss: the request's query and the query after each
    history position, each scoring its target against one uniformly drawn negative."""
    (qf, vf, pf), (q, v, p) = model.encode_positions(r, catalog)
    has, target = next_targets(r, hist_ts, device)  # [B, L-1], [P]

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


def draw(pool: np.ndarray, count: int, rng: np.random.Generator) -> np.ndarray:
    """[B, count]: from each row of pool [B, P], `count` ads drawn uniformly (with replacement)."""
    pick = rng.integers(0, pool.shape[1], (len(pool), count))
    return np.take_along_axis(pool, pick, axis=1)


def ranking_loss(model, r, catalog, pos, pop, n_ads, cfg, rng, device, hard=None):
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
