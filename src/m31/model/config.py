"""Model configuration, with named presets."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace

EXPERT_FAMILIES = ("sequence", "cohort", "semantic", "coengagement")
MODEL_KINDS = ("moe", "two-tower", "ranking", "dense")
# The sequence expert: causal self-attention over the engagements (`m31.model.sequence`), or the
# attention pool with one learned query per slot that preceded it (kept for ablations).
SEQUENCE_ENCODERS = ("transformer", "pool")
# The retrieval models' training loss (`m31.training.train`): a sampled softmax over in-batch and
# uniform negatives with logQ correction; the full softmax, cross-entropy over every ad of the
# catalogue (no sampling: exact, and cheap where the catalogue has tens of thousands of items);
# or SASRec's binary cross-entropy of each target against one uniformly drawn negative.
LOSSES = ("softmax", "full", "bce")


@dataclass(frozen=True)
class ModelConfig:
    kind: str = "moe"
    # Expert slots per tower family; their sum is E. A family with several slots gives each its
    # own attention query (sequence, semantic) or its own offset (cohort, co-engagement).
    experts: dict[str, int] = field(
        default_factory=lambda: {"sequence": 3, "cohort": 1, "semantic": 2, "coengagement": 2}
    )
    # G; 0 leaves the gate without ad keys: softmax(p), the same expert weights for every ad
    gate_dim: int = 64
    value_dim: int = 64  # D
    hidden: int = 64  # width of embeddings and tower trunks
    max_len: int = 20  # engagement-sequence length
    # one of SEQUENCE_ENCODERS: the attention pool by default (the tiny and demo presets: on
    # the demo world's 3 epochs the transformer trails it, docs/QUALITY.md), the causal
    # transformer where sequences carry the signal (the sasrec preset)
    sequence_encoder: str = "pool"
    sequence_blocks: int = 2  # causal self-attention blocks of the transformer
    sequence_heads: int = 2
    sequence_time: bool = True  # embed each engagement's time-since-request bucket
    # the attention pools' learned null key: attended only where the history is empty (False), so
    # that a pool cannot collapse onto it and give every user the same vector, or beside the
    # history too (True, the checkpoints before 2026-12-03; `m31.model.towers.AttentionPool`)
    pool_sink: bool = False
    dropout: float = 0.2  # of the transformer's attention, residual branches and input
    # train the sequence expert with a target at every history position (the next engagement),
    # not only at the request (transformer only; `m31.training.train`)
    every_position: bool = True
    id_buckets: int = 1 << 17  # hashed ad-id embedding rows (unseen ids still land somewhere)
    advertiser_buckets: int = 1 << 14
    # hashed item-attribute token rows (`m31.features.attributes`); 0: attributes not read
    attribute_buckets: int = 1 << 16
    ranking_mlp: tuple[int, ...] = (256, 128)
    # training
    loss: str = "softmax"  # one of LOSSES; bce trains the retrieval models only
    batch_size: int = 512
    uniform_negatives: int = 512
    ranking_negatives: int = 32  # uniform negatives per request for the ranking model
    ranking_in_batch: int = 31  # in-batch negatives per request for the ranking model
    # hard negatives per request for the ranking model, drawn from a retrieval model's top
    # `ranking_hard_pool` ads for the request (0: none; `m31.training.hard_negative_pool`)
    ranking_hard: int = 0
    ranking_hard_pool: int = 500
    # the config of a retrieval model whose score the ranking model adds to its own (its weights
    # travel in the ranking model's, frozen): the ranking model then learns a correction to that
    # model's order and starts from it (`m31.model.ranking`). None: the ranking model alone.
    ranking_base: dict | None = None
    lr: float = 2e-3
    weight_decay: float = 1e-5
    balance_weight: float = 0.02  # weight of the gate's load-balancing (mutual information) term
    epochs: int = 5
    patience: int = 2  # epochs without validation improvement before stopping
    val_requests: int = 2000  # 0: every request of the validation split
    val_metric: str = "hr@50"  # the validation metric the best epoch is chosen on
    # exclude the user's engaged ads from validation's ranking: None lets the dataset's
    # `repeat_engagement` decide; a protocol (`m31.eval.protocol`) sets it
    val_exclude_seen: bool | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in MODEL_KINDS:
            raise ValueError(f"kind must be one of {', '.join(MODEL_KINDS)}, got {self.kind!r}")
        unknown = set(self.experts) - set(EXPERT_FAMILIES)
        if unknown:
            raise ValueError(
                f"unknown expert families {sorted(unknown)}; choose from {', '.join(EXPERT_FAMILIES)}"
            )
        if self.n_experts < 1 or any(v < 0 for v in self.experts.values()):
            raise ValueError(f"experts needs at least one slot, got {self.experts}")
        if self.loss not in LOSSES:
            raise ValueError(f"loss must be one of {', '.join(LOSSES)}, got {self.loss!r}")
        if self.loss != "softmax" and self.kind not in ("moe", "two-tower"):
            raise ValueError(
                f"the {self.loss} loss trains retrieval models, not a {self.kind} model"
            )
        if self.attribute_buckets < 0:
            raise ValueError(f"attribute_buckets must be >= 0, got {self.attribute_buckets}")
        for name in ("hidden", "value_dim", "max_len", "batch_size", "epochs", "sequence_blocks"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.sequence_encoder not in SEQUENCE_ENCODERS:
            raise ValueError(
                f"sequence_encoder must be one of {', '.join(SEQUENCE_ENCODERS)}, "
                f"got {self.sequence_encoder!r}"
            )
        if self.sequence_heads < 1 or self.hidden % self.sequence_heads:
            raise ValueError(
                f"sequence_heads must divide hidden ({self.hidden}), got {self.sequence_heads}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must lie in [0, 1), got {self.dropout}")
        if self.val_requests < 0:
            raise ValueError(f"val_requests must be >= 0 (0: all), got {self.val_requests}")
        kind, _, k = self.val_metric.partition("@")
        if kind not in ("hr", "ndcg") or not k.isdigit() or int(k) < 1:
            raise ValueError(f"val_metric must be hr@K or ndcg@K, got {self.val_metric!r}")
        if self.gate_dim < 0:
            raise ValueError(f"gate_dim must be >= 0 (0: no per-ad routing), got {self.gate_dim}")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"lr must be a positive finite number, got {self.lr}")
        if not (math.isfinite(self.balance_weight) and self.balance_weight >= 0):
            raise ValueError(
                f"balance_weight must be a finite number >= 0, got {self.balance_weight}"
            )
        if self.ranking_hard < 0 or self.ranking_hard_pool < 1:
            raise ValueError(
                f"ranking_hard must be >= 0 and ranking_hard_pool >= 1, got "
                f"{self.ranking_hard} and {self.ranking_hard_pool}"
            )
        if self.ranking_hard and self.kind != "ranking":
            raise ValueError(f"hard negatives train the ranking model, not a {self.kind} model")
        if self.ranking_base is not None:
            if self.kind != "ranking":
                raise ValueError(f"a base model is the ranking model's, not a {self.kind} model's")
            base = self.base_config()
            if base.kind == "ranking":
                raise ValueError("the ranking model's base must be a moe or two-tower model")

    @property
    def n_experts(self) -> int:
        """E: for the two-tower and dense models always 1."""
        return 1 if self.kind in ("two-tower", "dense") else sum(self.experts.values())

    @property
    def val_k(self) -> int:
        """The cut-off of `val_metric`."""
        return int(self.val_metric.partition("@")[2])

    @property
    def trains_every_position(self) -> bool:
        """Whether training puts a target at every history position (`every_position`): with
        the causal sequence encoder and a sequence expert; for the two-tower model, only when
        no family pools the whole history (its one query needs every family at every
        position: `UserFeatures.position_families`)."""
        used = {name for name, k in self.experts.items() if k > 0}
        return (
            self.every_position
            and self.sequence_encoder == "transformer"
            and self.kind not in ("ranking", "dense")
            and "sequence" in used
            and (self.kind == "moe" or used <= {"sequence", "cohort"})
        )

    @property
    def pooled_families(self) -> tuple[str, ...]:
        """The families whose history an attention pool reads (its null key: `pool_sink`):
        semantic, and sequence unless the transformer reads it."""
        return tuple(
            name
            for name, k in self.experts.items()
            if k > 0
            and (name == "semantic" or (name == "sequence" and self.sequence_encoder == "pool"))
        )

    @property
    def effective_gate_dim(self) -> int:
        return 0 if self.kind in ("two-tower", "dense") else self.gate_dim

    def base_config(self) -> ModelConfig | None:
        """The config of the retrieval model under a ranking model (`ranking_base`), if any."""
        return None if self.ranking_base is None else ModelConfig.from_dict(self.ranking_base)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> ModelConfig:
        d = dict(d)
        d["ranking_mlp"] = tuple(d["ranking_mlp"])
        # a config written before the transformer had the attention pool
        d.setdefault("sequence_encoder", "pool")
        # a config written before the ad tower read item attributes
        d.setdefault("attribute_buckets", 0)
        # a config written before the pools' null key was only an empty history's
        d.setdefault("pool_sink", True)
        return cls(**d)

    def with_overrides(self, **kw) -> ModelConfig:
        return replace(self, **{k: v for k, v in kw.items() if v is not None})


# Fields `parse_settings` leaves to their own options: the kind, the expert slots, the gate's
# dimension and balance weight (`m31 train` checks them against the kind), the hard negatives
# and the base (they come with a checkpoint), and the epoch selection (`--protocol`'s).
_NOT_SETTABLE = (
    "kind", "experts", "gate_dim", "balance_weight", "ranking_base", "ranking_hard",
    "ranking_hard_pool", "val_requests", "val_metric", "val_exclude_seen",
)  # fmt: skip


def parse_settings(items: list[str]) -> dict:
    """`NAME=VALUE` settings of ModelConfig fields (`m31 train --set`), each value parsed
    strictly as its field's type: an integer as written (no "1.0", no "true"), a finite
    float, true or false, a name, or a comma-separated tuple of integers; ValueError naming
    the setting. What the values must satisfy beyond their type, ModelConfig checks."""
    from dataclasses import fields

    types = {f.name: f.type for f in fields(ModelConfig) if f.name not in _NOT_SETTABLE}
    out: dict = {}
    for item in items:
        name, sep, text = item.partition("=")
        where = f"--set {item!r}"
        if not sep or name not in types:
            raise ValueError(f"{where}: expected NAME=VALUE with NAME one of {', '.join(types)}")
        if name in out:
            raise ValueError(f"{where}: {name} is set twice")
        kind = types[name]
        if kind == "bool":
            if text not in ("true", "false"):
                raise ValueError(f"{where}: {name} is true or false")
            out[name] = text == "true"
        elif kind == "int":
            if not text.lstrip("-").isdigit() or text.startswith("+"):
                raise ValueError(f"{where}: {name} is an integer")
            out[name] = int(text)
        elif kind == "float":
            try:
                value = float(text)
            except ValueError:
                raise ValueError(f"{where}: {name} is a number") from None
            if not math.isfinite(value):
                raise ValueError(f"{where}: {name} is a finite number")
            out[name] = value
        elif kind.startswith("tuple"):
            parts = text.split(",")
            if not all(part.isdigit() for part in parts):
                raise ValueError(f"{where}: {name} is integers separated by commas")
            out[name] = tuple(int(part) for part in parts)
        else:
            out[name] = text
    return out


PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(
        experts={"sequence": 1, "cohort": 1, "semantic": 1, "coengagement": 1},
        gate_dim=16,
        value_dim=16,
        hidden=16,
        max_len=8,
        id_buckets=1 << 12,
        advertiser_buckets=1 << 8,
        attribute_buckets=1 << 10,
        ranking_mlp=(32, 16),
        batch_size=64,
        uniform_negatives=64,
        ranking_negatives=16,
        ranking_in_batch=15,
        epochs=2,
        val_requests=200,
    ),
    "demo": ModelConfig(),
    # The sequence expert alone, SASRec's shape (Kang & McAuley 2018, as run by S3-Rec on the
    # Amazon files): h = 64, 2 blocks, 2 heads, 50 engagements, dropout 0.5, lr 1e-3, batches of
    # 256; one slot and no gate keys, so the moe is a two-tower over it. The data has no clock
    # (`"clock": "order"`), so no time input. The retrieval models train with the full softmax
    # (on Beauty's validation it passed the sampled softmax's best epoch of three seeds in a
    # fifth of their epochs, docs/QUALITY.md); up to 60 epochs, stopping after 5 without gain.
    "sasrec": ModelConfig(
        experts={"sequence": 1, "cohort": 0, "semantic": 0, "coengagement": 0},
        sequence_encoder="transformer",
        gate_dim=0,
        max_len=50,
        sequence_heads=2,
        sequence_time=False,
        dropout=0.5,
        loss="full",
        lr=1e-3,
        batch_size=256,
        epochs=60,
        patience=5,
    ),
}


def model_preset(name: str, kind: str) -> ModelConfig:
    """A preset for one kind of model. The ranking model reads a longer history, and validates
    on a tenth of the requests: it scores the full corpus at hundreds of times the cost. The pair
    models (ranking, dense) train with their own softmax over per-request candidates whatever
    the preset's retrieval loss."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {', '.join(PRESETS)}")
    loss = PRESETS[name].loss if kind in ("moe", "two-tower") else "softmax"
    cfg = replace(PRESETS[name], kind=kind, loss=loss)
    if kind == "ranking":
        return replace(cfg, max_len=cfg.max_len * 3, val_requests=max(cfg.val_requests // 10, 100))
    return cfg
