"""Trained checkpoints evaluated on a dataset folder (`m31 eval`; DESIGN §8). The funnel and
the auction of checkpoints: `m31.eval.simulations`.

Shapes: S training seeds (checkpoints) of a model, n test requests, A ads.

A model given with several checkpoints (training seeds) is reported as mean ± sample standard
deviation over them; two models are compared request by request (per-request metric averaged
over seeds) with a 95% percentile-bootstrap interval over test requests (`m31.eval.stats`).
Checkpoints are evaluated in rounds: round s holds the s-th checkpoint of every model, so memory
holds one checkpoint per model; baselines (deterministic) go with round 0.

Messages name the command line's options (`--model`, `--compare`, ...), whose values these
functions take.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from m31.eval.metrics import hit_rate_at_k, ndcg_at_k
from m31.eval.offline import Progress, evaluate, examples
from m31.eval.records import (
    Record,
    RecordedRun,
    load_record,
    requests_fingerprint,
    save_record,
)
from m31.eval.stats import (
    PairedComparison,
    SeedSummary,
    aggregate_seeds,
    format_paired,
    format_seed_table,
    paired_comparison,
    per_request,
)
from m31.features import Features
from m31.model import Catalog, ScoreFunction, load_checkpoint


def load_scorer(
    path: Path, feats: Features, device: str = "cpu", catalog: Catalog | None = None
) -> ScoreFunction:
    """The checkpoint `path` as `m31.eval` scores with it, over `feats` (checked: the features
    and split it was trained on); its ads read from `catalog` (default: the features' catalogue
    on `device`). The model and its config: `.model`, `.model.cfg`; its training: `.history`."""
    model, blob = load_checkpoint(Path(path), feats, device=device)
    if catalog is None:
        catalog = Catalog.from_features(feats).to(device)
    return ScoreFunction(model, feats, catalog, history=blob["history"])


@dataclass
class SeedRuns:
    """Each model's results, one entry per round (training seed): metrics, the target's rank
    on each request [n] and, on a synthetic world, each request's truth recall."""

    metrics: dict[str, list[dict[str, float]]] = field(default_factory=dict)
    ranks: dict[str, list[np.ndarray]] = field(default_factory=dict)
    truth_recall: dict[str, list[dict[str, np.ndarray]]] = field(default_factory=dict)

    def add(self, name: str, metrics: dict, ranks: np.ndarray, truth_recall=None) -> None:
        self.metrics.setdefault(name, []).append(metrics)
        self.ranks.setdefault(name, []).append(ranks)
        if truth_recall is not None:
            self.truth_recall.setdefault(name, []).append(truth_recall)

    @property
    def requests(self) -> int:
        return len(next(iter(self.ranks.values()))[0])

    def summaries(self) -> dict[str, dict[str, SeedSummary]]:
        """Each model's metrics over its seeds: those every seed has (a recorded seed has no
        ref_overlap, which depends on the other models of its call)."""
        out = {}
        for name, runs in self.metrics.items():
            common = [k for k in runs[0] if all(k in r for r in runs)]
            out[name] = aggregate_seeds([{k: r[k] for k in common} for r in runs])
        return out

    def paired(self, a: str, b: str, metric: str) -> PairedComparison:
        """`a` against `b` on `metric` (hr@K, ndcg@K or truth_recall@K), request by request."""
        if metric.startswith("truth_recall@"):
            x, y = (np.stack([seed[metric] for seed in self.truth_recall[m]]) for m in (a, b))
        else:
            x, y = (per_request(np.stack(self.ranks[m]), metric) for m in (a, b))
        return paired_comparison(x, y)


@dataclass(frozen=True)
class Rerank:
    """A two-stage model, named FIRST>SECOND: SECOND (a ranking model) orders FIRST's top k.
    With `only`, SECOND scores FIRST's candidates only, never the whole corpus."""

    first: str
    second: str
    k: int = 500
    only: bool = False

    @property
    def name(self) -> str:
        return f"{self.first}>{self.second}"


@dataclass
class EvalReport:
    """What `m31 eval` prints and writes."""

    requests: int
    ads: int
    exclude_seen: bool
    truth: bool  # a synthetic world: truth_recall@K was measured
    runs: dict[str, list[dict[str, float]]]  # model -> its metrics, one dict per seed
    summaries: dict[str, dict[str, SeedSummary]]  # model -> metric -> over seeds
    paired: list[tuple[str, str, dict[str, PairedComparison]]]  # (a, b, metric -> a vs b)
    flops: dict[str, int] = field(default_factory=dict)  # model -> FLOPs per (request, ad) pair
    trainings: list[tuple[str, str, str]] = field(default_factory=list)  # (model, file, in words)

    def means(self) -> dict[str, dict[str, float]]:
        return {name: {k: v.mean for k, v in m.items()} for name, m in self.summaries.items()}

    def format(self) -> str:
        lines = [
            f"{self.requests:,} test requests, {self.ads:,} ads each (full corpus), "
            f"seen ads {'excluded' if self.exclude_seen else 'kept'}",
            format_seed_table(self.summaries),
        ]
        if self.flops:
            lines.append(
                "FLOPs per (request, ad) pair: "
                + ", ".join(f"{name} {n:,}" for name, n in self.flops.items())
            )
        if self.trainings:
            lines.append("Trained:")
            lines += [f"  {name} ({file}): {text}" for name, file, text in self.trainings]
        for a, b, paired in self.paired:
            lines.append(
                f"\n{a} vs {b}, paired on the same {self.requests:,} requests (per-request "
                "metric averaged over seeds; 95% percentile bootstrap over requests):"
            )
            lines.append(format_paired(a, b, paired))
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {
            "requests": self.requests,
            "means": self.means(),
            "std": {  # null with one seed
                name: {k: None if np.isnan(v.std) else v.std for k, v in m.items()}
                for name, m in self.summaries.items()
            },
            "runs": self.runs,
            "flops_per_pair": self.flops,
            "trainings": [{"model": n, "file": f, "training": t} for n, f, t in self.trainings],
            "paired": [  # one entry per comparison
                {"a": a, "b": b, **{k: c.as_dict() for k, c in paired.items()}}
                for a, b, paired in self.paired
            ],
        }

    def baselines(self, metric: str) -> dict[str, float]:
        """Each model without FLOPs counted (a baseline): its mean `metric`."""
        return {
            name: m[metric].mean
            for name, m in self.summaries.items()
            if name not in self.flops and metric in m
        }

    def pareto(self, metric: str) -> dict[str, tuple[int, float, float]]:
        """Each model with a checkpoint: (FLOPs per pair, mean `metric`, its std over seeds)."""
        return {
            name: (n, self.summaries[name][metric].mean, self.summaries[name][metric].std)
            for name, n in self.flops.items()
            if name in self.summaries
        }


def evaluate_runs(
    data: Path,
    runs: Sequence[tuple[str, Path]],
    baselines: Sequence[str] = (),
    *,
    split: str = "leave-last-out",
    ks: Sequence[int] = (10, 50, 100, 500),
    protocol: str | None = None,
    max_users: int | None = None,
    exclude_seen: bool | None = None,
    reference: str | None = None,
    rerank: Rerank | None = None,
    compare: Sequence[tuple[str, str]] = (),
    records: Sequence[Path] = (),
    record: Path | None = None,
    device: str = "cpu",
    progress: Progress | None = None,
) -> EvalReport:
    """Full-corpus metrics of checkpoints and baselines on the same test requests of `data`.

    `runs`: (name, checkpoint) pairs, a name repeated for several training seeds; the name ""
    is the checkpoint's model kind. `protocol` (`m31.eval.protocol`) sets the split, cut-offs
    and exclusions. `exclude_seen` None: as the dataset's meta says (`repeat_engagement`).
    `reference`: the model whose top K the others are compared with (default: a ranking model
    evaluated beside others). `compare`: the pairs compared request by request (default:
    moe against two-tower when both are evaluated). `records`: evaluation records
    (`m31.eval.records`) of earlier calls on the same requests, whose models join the report
    as if scored here (a name also given here or in another record: more seeds of it).
    `record`: write what this call scores to that file.
    """
    from m31.data import dataset
    from m31.features.folder import features_for
    from m31.world.truth import GroundTruth

    proto = None
    if protocol is not None:
        proto = _protocol(protocol, max_users, exclude_seen)
        split, ks, exclude_seen = proto.split, proto.ks, proto.exclude_history
    if not runs and not baselines and not records:
        raise ValueError("nothing to evaluate: give --model, --baselines or --from-record")
    feats = features_for(data, split)
    truth = None
    if (Path(data) / "truth.npz").is_file():
        truth = GroundTruth.from_arrays(dataset.load_truth(data))
    if exclude_seen is None:
        exclude_seen = not dataset.repeat_engagement(feats.meta)
    base_fns = _baselines(baselines, feats)

    groups: dict[str, list[Path]] = {}  # a bare checkpoint is its own model, named when loaded
    for name, path in runs:
        groups.setdefault(name or f"\0{path}", []).append(Path(path))
    rounds = _Rounds(feats, Catalog.from_features(feats).to(device), device, proto)
    for s in range(max((len(p) for p in groups.values()), default=1 if base_fns else 0)):
        fns, sources = rounds.load(s, groups, base_fns if s == 0 else {})
        stages = _stages(s, fns, rerank, rounds.latest) if rerank is not None else {}
        if reference is None and "ranking" in fns and len(fns) > 1:
            reference = "ranking"
        options = {"ks": tuple(ks), "max_users": max_users, "exclude_seen": exclude_seen}
        rounds.score(fns, sources, stages, reference, truth=truth, progress=progress, **options)
        del fns

    seeds, flops, scored = rounds.seeds, rounds.flops, rounds.scored
    if records or record is not None:
        req, target = examples(feats, "test", max_users, seed=0)
        fingerprint = requests_fingerprint(req, target, feats.n_ads, exclude_seen)
        if record is not None:
            save_record(Record(fingerprint, Path(data).name, tuple(ks), scored, flops), record)
        has_truth = truth is not None
        scored += _add_records(seeds, flops, records, fingerprint, tuple(ks), has_truth, scored)
    return EvalReport(
        requests=seeds.requests,
        ads=feats.n_ads,
        exclude_seen=exclude_seen,
        truth=truth is not None,
        runs=seeds.metrics,
        summaries=seeds.summaries(),
        paired=_paired(seeds, compare, ks),
        flops=flops,
        trainings=[(run.model, run.source, t) for run in scored if (t := run.training())],
    )


def _baselines(names: Sequence[str], feats: Features) -> dict:
    from m31.eval.baselines import make_baselines

    try:
        return make_baselines(list(names), feats)
    except ValueError as e:
        raise ValueError(f"--baselines: {e}") from e


def _protocol(name: str, max_users: int | None, exclude_seen: bool | None):
    """The named protocol (`m31.eval.protocol`), which evaluates every user with the history
    excluded: options that ask otherwise are refused."""
    from m31.eval.protocol import protocol

    proto = protocol(name)
    if max_users is not None or exclude_seen is False:
        raise ValueError(f"--protocol {name}: every user is evaluated, the history excluded")
    return proto


def _stages(s: int, fns: dict, rerank: Rerank, latest: dict) -> dict:
    """The round's two-stage model (`--rerank`): its first stage's scores re-ranked by the
    second's latest checkpoint (a second stage with fewer seeds serves the later rounds too).
    With `rerank.only`, the second stage is scored as a stage only."""
    if s == 0 and (rerank.first not in fns or rerank.second not in fns):
        raise ValueError(
            f"--rerank: {rerank.first!r} and {rerank.second!r} must both be given with --model"
        )
    stages = {}
    if rerank.first in fns:
        stages[rerank.name] = (rerank.first, latest[rerank.second].rank, rerank.k)
    if rerank.only:
        fns.pop(rerank.second, None)
    return stages


def _paired(seeds: SeedRuns, compare: Sequence[tuple[str, str]], ks) -> list:
    """Each compared pair's paired intervals of every metric (default: moe against two-tower
    when both are evaluated)."""
    if not compare and {"moe", "two-tower"} <= set(seeds.ranks):
        compare = [("moe", "two-tower")]
    names = [f"{kind}@{k}" for kind in ("hr", "ndcg") for k in ks]
    names += [f"truth_recall@{k}" for k in ks] if seeds.truth_recall else []
    paired = []
    for a, b in compare:
        if a not in seeds.ranks or b not in seeds.ranks:
            raise ValueError(f"--compare: need two evaluated models A,B, got {f'{a},{b}'!r}")
        paired.append((a, b, {metric: seeds.paired(a, b, metric) for metric in names}))
    return paired


@dataclass
class _Rounds:
    """What `evaluate_runs` gathers over its rounds, one per training seed: each model's
    metrics and ranks by seed, its last loaded checkpoint, its FLOPs per pair, and what the
    call scored (for `--record`)."""

    feats: Features
    catalog: Catalog
    device: str
    proto: object | None  # the protocol each checkpoint is checked against
    seeds: SeedRuns = field(default_factory=SeedRuns)
    latest: dict[str, ScoreFunction] = field(default_factory=dict)
    flops: dict[str, int] = field(default_factory=dict)
    scored: list[RecordedRun] = field(default_factory=list)

    def load(self, s: int, groups: dict[str, list[Path]], base_fns: dict) -> tuple[dict, dict]:
        """(the round's score functions: `base_fns` and each model's `s`-th checkpoint, where
        each came from)."""
        fns = dict(base_fns)
        sources = dict.fromkeys(fns, ("baseline", None, None))
        for key, paths in groups.items():
            if s >= len(paths):
                continue
            fn = load_scorer(paths[s], self.feats, self.device, self.catalog)
            if self.proto is not None:
                self.proto.check_model(fn.model.cfg, paths[s])
            name = fn.model.cfg.kind if key.startswith("\0") else key
            if name in fns:
                raise ValueError(f"two models are named {name!r}; name them NAME=PATH")
            fns[name] = self.latest[name] = fn
            self.flops[name] = fn.model.flops_per_pair()
            sources[name] = (paths[s].name, fn.history, fn.model.cfg.val_metric)
        return fns, sources

    def score(self, fns: dict, sources: dict, stages: dict, reference, **options) -> None:
        """Score the round's models and stages on the test requests (`evaluate` `options`).
        A reference with fewer seeds than the others serves the later rounds as well, so that
        every round reports the same metrics; its own metrics count once per checkpoint."""
        reused = None
        if reference in self.latest and reference not in fns:
            fns[reference] = self.latest[reference]
            reused = reference
        metrics, ranks, *rows = evaluate(
            fns,
            self.feats,
            split="test",
            reference=reference if reference in fns else None,
            return_ranks=True,
            rerank=stages,
            return_truth_recall=options["truth"] is not None,
            **options,
        )
        for name in [*fns, *stages]:
            if name == reused:
                continue
            truth_rows = rows[0][name] if rows else None
            self.seeds.add(name, metrics[name], ranks[name], truth_rows)
            source, *training = sources.get(name, (name, None, None))  # a stage: FIRST>SECOND
            self.scored.append(RecordedRun(name, ranks[name], truth_rows, source, *training))


def _add_records(
    seeds: SeedRuns,
    flops: dict[str, int],
    paths: Sequence[Path],
    fingerprint: str,
    ks: tuple[int, ...],
    truth: bool,
    earlier: Sequence[RecordedRun],
) -> list[RecordedRun]:
    """The runs of the records at `paths` added to `seeds` (and their FLOPs to `flops`), each
    checked to be of the requests `fingerprint` names and not to be a run of `earlier` (those
    scored live) or of another record again; their metrics at the cut-offs `ks`. Returns the
    runs."""
    added: list[RecordedRun] = []
    for path in paths:
        rec = load_record(path)
        if rec.fingerprint != fingerprint:
            raise ValueError(
                f"--from-record: {path} was measured on other requests ({rec.requests:,} of "
                f"{rec.data!r}); give the --data, --split (or --protocol), --max-users and "
                "--exclude-seen it was recorded with"
            )
        if truth and not set(ks) <= set(rec.ks):
            raise ValueError(
                f"--from-record: {path} has the truth recall at K = "
                f"{', '.join(map(str, rec.ks))}, not at every K of --ks"
            )
        for name, n in rec.flops.items():
            if flops.setdefault(name, n) != n:
                raise ValueError(
                    f"--from-record: {path}'s {name!r} costs {n:,} FLOPs per pair, another "
                    f"{name!r} here {flops[name]:,}: two models under one name"
                )
        for run in rec.runs:
            if run.source == "baseline" and run.model in seeds.ranks:
                raise ValueError(
                    f"--from-record: {path} holds the baseline {run.model!r}, which is scored "
                    "here already (live, or in another record): a baseline is deterministic, "
                    "and twice it would count as two training seeds; give it once"
                )
            if run.history and any(_same_training(run, e) for e in (*earlier, *added)):
                raise ValueError(
                    f"--from-record: {path} holds the {run.model!r} training of {run.source}, "
                    "which is scored here already (live, or in another record): twice it "
                    "would count as two training seeds; give it once"
                )
            # as `evaluate` computes them from the ranks
            metrics = {f"hr@{k}": hit_rate_at_k(run.ranks, k) for k in ks}
            metrics.update({f"ndcg@{k}": ndcg_at_k(run.ranks, k) for k in ks})
            rows = None
            if truth:
                rows = {f"truth_recall@{k}": run.truth_recall[f"truth_recall@{k}"] for k in ks}
                metrics.update({key: float(v.mean()) for key, v in rows.items()})
            seeds.add(run.model, metrics, run.ranks, rows)
            added.append(run)
    return added


def _same_training(a: RecordedRun, b: RecordedRun) -> bool:
    """One training scored twice: the same model and checkpoint file, and the same history,
    epoch by epoch (its losses and seconds tell two trainings apart, even of one seed)."""
    return (a.model, a.source, a.history) == (b.model, b.source, b.history)
