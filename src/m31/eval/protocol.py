"""Named evaluation protocols: the settings a published table's figures were measured under,
so that `m31 eval --protocol NAME` and `m31 train --protocol NAME` (which selects its epoch on
the same settings, on the validation split) reproduce them (DESIGN §8).

`loo-position`, the sequential-recommendation protocol of SASRec, S3-Rec, ICLRec and later work
on the Amazon files (`../shared/data/amazon-sr/README.md`):

* leave-one-out by position: a user's last engagement is the test target, the one before it the
  validation target, the rest is training. That is the leave-last-out split
  (`m31.features.build._split`); an imported sequence file's clock is its order (one event a
  day), so time order is position order and no two events share a second;
* the history a model reads is the engagements before the target (for the test target the
  validation one included), at most the last 50;
* every item is ranked, over every user (no sampled negatives, no subset of users);
* the user's history items are excluded from the ranking, whatever the dataset's
  `repeat_engagement` says (`m31.eval.offline.seen_mask`: the whole history, not only the last
  50). Where the target itself is in the history (a repeat), m31 keeps it rankable; the
  published code masks it too. The Amazon files have no repeats, so the two agree there;
* HR@5/10/20 and NDCG@5/10/20, averaged over users. Ties rank the lower item row first
  (`m31.eval.metrics`, DESIGN §2); the published code breaks them arbitrarily;
* training selects its epoch on NDCG@10 of every validation request (S3-Rec's choice).
"""

from __future__ import annotations

from dataclasses import dataclass

from m31.model.config import ModelConfig


@dataclass(frozen=True)
class Protocol:
    name: str
    split: str  # the feature split it needs
    ks: tuple[int, ...]  # cut-offs of HR@K and NDCG@K
    max_history: int  # the longest history a model may read
    exclude_history: bool  # the user's engaged items are out of the ranking
    select_on: str  # the validation metric training chooses its epoch on

    def training(self, cfg: ModelConfig) -> ModelConfig:
        """`cfg` validated under the protocol: every validation request, the history excluded,
        the epoch chosen on `select_on`. Refuses a model that reads a longer history."""
        if cfg.max_len > self.max_history:
            raise ValueError(
                f"protocol {self.name}: a model reads at most {self.max_history} engagements, "
                f"this one {cfg.max_len} (--max-len)"
            )
        return cfg.with_overrides(
            val_requests=0, val_exclude_seen=self.exclude_history, val_metric=self.select_on
        )

    def check_model(self, cfg: ModelConfig, path: object) -> None:
        if cfg.max_len > self.max_history:
            raise ValueError(
                f"protocol {self.name}: {path} reads {cfg.max_len} engagements, more than the "
                f"protocol's {self.max_history}"
            )


PROTOCOLS: dict[str, Protocol] = {
    "loo-position": Protocol(
        name="loo-position",
        split="leave-last-out",
        ks=(5, 10, 20),
        max_history=50,
        exclude_history=True,
        select_on="ndcg@10",
    ),
}


def protocol(name: str) -> Protocol:
    try:
        return PROTOCOLS[name]
    except KeyError:
        raise ValueError(
            f"unknown protocol {name!r}; choose one of {', '.join(PROTOCOLS)}"
        ) from None
