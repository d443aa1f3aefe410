"""Inference-time ablations of a moe (m31.eval.ablation): what each variant does to the gate."""

import pytest
import torch

from m31.eval.ablation import ablations, expert_slots, keep_slots, uniform_gate
from m31.model.config import ModelConfig
from m31.ops import score


def problem(n_req=3, n_ads=11, n_exp=8, dim=5, seed=0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    return (r(n_req, n_exp, dim), r(n_req, n_exp, dim), r(n_req, n_exp)), (
        r(n_ads, dim),
        r(n_ads, dim),
        r(n_ads),
    )


def test_expert_slots_follow_the_models_order():
    cfg = ModelConfig(experts={"sequence": 3, "cohort": 0, "semantic": 2, "coengagement": 1})
    assert expert_slots(cfg) == {"sequence": [0, 1, 2], "semantic": [3, 4], "coengagement": [5]}
    with pytest.raises(ValueError, match="moe"):
        expert_slots(ModelConfig(kind="two-tower"))
    names = list(ablations(cfg))
    assert names[:2] == ["full", "uniform gate"] and ablations(cfg)["full"] is None
    assert set(names[2:]) == {f"{w} {f}" for w in ("without", "only") for f in expert_slots(cfg)}
    one_family = ModelConfig(experts={"sequence": 4, "cohort": 0, "semantic": 0, "coengagement": 0})
    assert list(ablations(one_family)) == ["full", "uniform gate"]


def test_uniform_gate_weighs_every_expert_equally():
    query, table = problem()
    s, gate = score(*uniform_gate(*query), *table, return_gate=True)
    torch.testing.assert_close(gate, torch.full_like(gate, 1 / 8))
    aff = torch.einsum("bed,nd->bne", query[1], table[1])
    torch.testing.assert_close(s, aff.mean(-1) + table[2])


def test_keep_slots_renormalises_the_gate_over_the_kept_slots():
    query, table = problem(seed=1)
    kept = [1, 4, 5]
    _, gate = score(*query, *table, return_gate=True)
    s, restricted = score(*keep_slots(kept)(*query), *table, return_gate=True)
    dropped = [e for e in range(8) if e not in kept]
    assert (restricted[..., dropped] == 0).all()
    want = gate[..., kept] / gate[..., kept].sum(-1, keepdim=True)
    torch.testing.assert_close(restricted[..., kept], want)
    assert torch.isfinite(s).all()
    q, v, _ = keep_slots(kept)(*query)
    assert q is query[0] and v is query[1]  # keys and values untouched
