"""Evaluation: full-corpus offline metrics, the simulated funnel and their plots (DESIGN §8)."""

from m31.eval.funnel import RankFn, RetrieveFn, crn_uniform, format_funnel, simulate
from m31.eval.metrics import (
    hit_rate_at_k,
    ndcg_at_k,
    overlap_at_k,
    recall_at_k,
    target_rank,
    topk_rows,
)
from m31.eval.offline import (
    Requests,
    ScoreFn,
    evaluate,
    format_table,
    requests_from_split,
    seen_mask,
)
from m31.eval.plot import plot_recall_at_k

__all__ = [
    "RankFn",
    "Requests",
    "RetrieveFn",
    "ScoreFn",
    "crn_uniform",
    "evaluate",
    "format_funnel",
    "format_table",
    "hit_rate_at_k",
    "ndcg_at_k",
    "overlap_at_k",
    "plot_recall_at_k",
    "recall_at_k",
    "requests_from_split",
    "seen_mask",
    "simulate",
    "target_rank",
    "topk_rows",
]
