"""The feature set (`Features`): what `m31.features.build.build_features` makes of a dataset,
what training and evaluation read, saved in a folder and loaded again, and its online part,
what serving reads.

Shapes: U users, A ads, H text-embedding dim, d co-engagement dim, L sequence length.

Folder layout (`Features.save`)::

    meta.json                  config, vocabularies, counts
    ads.parquet users.parquet  per-row categorical and numeric features
    text_emb.npy cooc_emb.npy  [A, H] and [A, d] float32
    attr_tokens.npy            [A, T] int64 item-attribute tokens (`m31.features.attributes`)
    engagements.parquet organic.parquet          the event sequences
    train.parquet val.parquet test.parquet impressions.parquet   examples

`Features.online` is what serving reads of them (DESIGN §1): no examples, and each user's last
engagements only (the user store); saved the same way, without the example files.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from m31.data.dataset import DatasetError
from m31.features.sequences import EventSequences
from m31.files import write_folder_atomic

SPLITS = ("leave-last-out", "time")
EXAMPLE_SETS = ("train", "val", "test", "impressions")


@dataclass(frozen=True)
class FeatureConfig:
    split: str = "leave-last-out"
    max_len: int = 50  # engagement-sequence length the models see
    organic_len: int = 32  # organic-engagement sequence length
    cooc_dim: int = 32
    cooc_window: int = 5
    time_split: tuple[float, float] = (0.8, 0.9)  # quantiles of engagement time: val, test start
    text_embeddings: bool = True  # False: zeros, for tests that do not need the encoder

    def __post_init__(self) -> None:
        if self.split not in SPLITS:
            raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {self.split!r}")
        if self.max_len <= 0 or self.organic_len <= 0:
            raise ValueError("max_len and organic_len must be positive")
        lo, hi = self.time_split
        if not 0.0 < lo < hi < 1.0:
            raise ValueError(
                f"time_split must be two quantiles 0 < val < test < 1, got {self.time_split}"
            )


@dataclass
class Features:
    config: FeatureConfig
    meta: dict
    ads: dict[str, np.ndarray]  # name -> [A]
    users: dict[str, np.ndarray]  # name -> [U]
    text_emb: np.ndarray  # [A, H]
    cooc_emb: np.ndarray  # [A, d]
    engagements: EventSequences  # values: item, surface
    organic: EventSequences  # values: topic, surface
    splits: dict[str, dict[str, np.ndarray]]  # train/val/test/impressions -> column -> [n]
    # [A, T] item-attribute tokens, -1 padding (`m31.features.attributes`); T = 0: none declared
    attr_tokens: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.attr_tokens is None:
            self.attr_tokens = np.zeros((self.n_ads, 0), dtype=np.int64)

    @property
    def is_online(self) -> bool:
        """Whether these are the online features (`online`): no examples, recent events only."""
        return bool(self.meta.get("online"))

    def online(self, max_len: int | None = None) -> Features:
        """What serving reads: the catalogue's and the users' features and each user's last
        `max_len` engagements (default: the config's) and last `organic_len` organic events,
        without the training examples. A request is read as of its time, so one dated before
        a user's kept events sees fewer of them than the full features would give."""
        cohorts = self.common_cohorts()
        return Features(
            config=self.config,
            meta={
                **self.meta,
                "online": True,
                "max_len": max_len or self.config.max_len,
                "country_cohort": [cohorts[c] for c in range(len(cohorts))],
            },
            ads=self.ads,
            users=self.users,
            text_emb=self.text_emb,
            cooc_emb=self.cooc_emb,
            attr_tokens=self.attr_tokens,
            engagements=self.engagements.last(max_len or self.config.max_len),
            organic=self.organic.last(self.config.organic_len),
            splits={},
        )

    @property
    def n_users(self) -> int:
        return len(self.users["user_id"])

    @property
    def n_ads(self) -> int:
        return len(self.ads["ad_id"])

    def history(self, users: np.ndarray, cutoffs: np.ndarray, max_len: int | None = None):
        """Engaged items, their surfaces and times strictly before each cutoff: [n, L] each."""
        values, ts, lengths = self.engagements.before(
            users, cutoffs, max_len or self.config.max_len
        )
        return values["item"], values["surface"], ts, lengths

    def common_cohorts(self) -> dict[int, int]:
        """The default cohort of an inline user by country code: the most common one among the
        users of its country who have one; the unknown cohort for a country whose users have
        none. Online features loaded without their users (`load(users=False)`) keep it."""
        known = self.meta.get("country_cohort")
        if known is not None:
            return dict(enumerate(known))
        vocab = self.meta["vocab"]
        return common_cohorts(self.users, len(vocab["country"]), len(vocab["cohort"]))

    def organic_history(self, users: np.ndarray, cutoffs: np.ndarray):
        """Organic topics strictly before each cutoff: [n, organic_len], padded with -1."""
        values, _, lengths = self.organic.before(users, cutoffs, self.config.organic_len)
        return values["topic"], lengths

    def describe(self) -> str:
        sizes = ", ".join(f"{k} {len(v['user']):,}" for k, v in self.splits.items())
        return (
            f"{self.n_users:,} users, {self.n_ads:,} ads, {len(self.engagements.ts):,} engagements, "
            f"split {self.config.split}: {sizes}"
        )

    def save(self, out: Path, overwrite: bool = False) -> Path:
        def fill(tmp: Path) -> None:
            meta = {**self.meta, "config": asdict(self.config)}
            (tmp / "meta.json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
            pq.write_table(pa.table(self.ads), tmp / "ads.parquet")
            pq.write_table(pa.table(self.users), tmp / "users.parquet")
            np.save(tmp / "text_emb.npy", self.text_emb)
            np.save(tmp / "cooc_emb.npy", self.cooc_emb)
            np.save(tmp / "attr_tokens.npy", self.attr_tokens)
            for name, seq in (("engagements", self.engagements), ("organic", self.organic)):
                user = np.repeat(np.arange(seq.n_users), np.diff(seq.offsets))
                pq.write_table(
                    pa.table({"user": user, "ts": seq.ts, **seq.values}), tmp / f"{name}.parquet"
                )
            for name, cols in self.splits.items():
                pq.write_table(pa.table(cols), tmp / f"{name}.parquet")

        return write_folder_atomic(Path(out), fill, overwrite=overwrite)

    @classmethod
    def load(cls, folder: Path, users: bool = True) -> Features:
        """The features saved in `folder`. `users=False`: online features without anything
        per user (no users' columns, engagements or organic events; the default cohorts by
        country kept, `common_cohorts`): what a cluster's ingress reads, whose memory must
        not grow with the users the shards hold."""
        folder = Path(folder)
        if not (folder / "meta.json").is_file():
            raise DatasetError(f"{folder / 'meta.json'}: missing (not a feature folder?)")
        meta = json.loads((folder / "meta.json").read_text())
        cfg = meta.pop("config")
        cfg["time_split"] = tuple(cfg["time_split"])
        config = FeatureConfig(**cfg)

        def table(name: str, rows: bool = True, columns=None) -> dict[str, np.ndarray]:
            path = folder / f"{name}.parquet"
            t = pq.read_table(path, columns=columns) if rows else pq.read_schema(path).empty_table()
            return {k: t[k].to_numpy() for k in t.column_names}

        if not users:
            if not meta.get("online"):
                raise ValueError(f"{folder}: users=False reads online features only")
            if "country_cohort" not in meta:  # online features written before they kept it
                held = table("users", columns=["country", "cohort"])
                vocab = meta["vocab"]
                cohorts = common_cohorts(held, len(vocab["country"]), len(vocab["cohort"]))
                meta["country_cohort"] = [cohorts[c] for c in range(len(vocab["country"]))]
        seqs = {}
        for name in ("engagements", "organic"):
            t = table(name, rows=users)
            user, ts = t.pop("user"), t.pop("ts")
            seqs[name] = EventSequences.from_events(user, ts, meta["n_users"] if users else 0, **t)
        return cls(
            config=config,
            meta=meta,
            ads=table("ads"),
            users=table("users", rows=users),
            text_emb=np.load(folder / "text_emb.npy"),
            cooc_emb=np.load(folder / "cooc_emb.npy"),
            # a folder written before the tokens (online features of an older snapshot): none
            attr_tokens=np.load(tokens)
            if (tokens := folder / "attr_tokens.npy").is_file()
            else None,
            engagements=seqs["engagements"],
            organic=seqs["organic"],
            splits={} if meta.get("online") else {name: table(name) for name in EXAMPLE_SETS},
        )


def common_cohorts(
    users: Mapping[str, np.ndarray], n_countries: int, n_cohorts: int
) -> dict[int, int]:
    """Country code -> the most common cohort code among `users` (columns country and cohort,
    codes) of that country who have one; `n_cohorts` (unknown) for a country with none."""
    common = {}
    for c in range(n_countries):
        held = users["cohort"][(users["country"] == c) & (users["cohort"] < n_cohorts)]
        common[c] = int(np.bincount(held).argmax()) if len(held) else n_cohorts
    return common
