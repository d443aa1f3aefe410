"""Model inputs as tensors: the ad catalogue's features and a batch of requests.

Shapes: A ads in the catalogue, B requests, L engagement-sequence length, Lo organic length,
H text-embedding dim, d co-engagement dim.

A request is (user, time, serving context). Its inputs are gathered from `Features` as of the
request time, so a model never sees an engagement at or after it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
import torch

from m31.features import Features

NO_ADVERTISER = -1  # the advertiser of an ad without one (advertiser ids are >= 0)
N_TIME_BUCKETS = 24  # log2 buckets of (request time - engagement time) in minutes, plus padding


def time_buckets(delta_s: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """0 for padding, else 1 + floor(log2(1 + minutes)), capped."""
    minutes = np.maximum(delta_s, 0) / 60.0
    bucket = 1 + np.floor(np.log2(1.0 + minutes)).astype(np.int64)
    return np.where(valid, np.minimum(bucket, N_TIME_BUCKETS - 1), 0)


@dataclass
class Catalog:
    """Per-ad features, one row per ad of the training catalogue."""

    ad_id: torch.Tensor  # [A] int64
    advertiser: torch.Tensor  # [A] int64 external advertiser id (hashed by the model), -1: none
    objective: torch.Tensor  # [A]
    format: torch.Tensor  # [A]
    topic: torch.Tensor  # [A]
    category: torch.Tensor  # [A]
    quality: torch.Tensor  # [A] float
    text_emb: torch.Tensor  # [A, H]
    cooc_emb: torch.Tensor  # [A, d]
    attributes: torch.Tensor  # [A, T] int64 item-attribute tokens, -1 padding (T may be 0)

    @classmethod
    def from_features(cls, feats: Features) -> Catalog:
        ads = feats.ads
        adv_vocab = np.asarray(feats.meta["vocab"]["advertiser"], dtype=np.int64)
        has = ads["advertiser"] >= 0  # [A]
        advertiser = np.full(len(has), NO_ADVERTISER, dtype=np.int64)  # [A]
        advertiser[has] = adv_vocab[ads["advertiser"][has]]
        return cls(
            ad_id=torch.from_numpy(ads["ad_id"].astype(np.int64)),
            advertiser=torch.from_numpy(advertiser),
            objective=torch.from_numpy(ads["objective"].astype(np.int64)),
            format=torch.from_numpy(ads["format"].astype(np.int64)),
            topic=torch.from_numpy(ads["topic"].astype(np.int64)),
            category=torch.from_numpy(ads["category"].astype(np.int64)),
            quality=torch.from_numpy(ads["quality"].astype(np.float32)),
            text_emb=torch.from_numpy(feats.text_emb),
            cooc_emb=torch.from_numpy(feats.cooc_emb),
            attributes=torch.from_numpy(feats.attr_tokens),
        )

    def __len__(self) -> int:
        return len(self.ad_id)

    def take(self, rows: torch.Tensor) -> Catalog:
        """The features of `rows` (any shape; -1 rows are read as row 0 and must be masked)."""
        safe = rows.clamp_min(0)
        return Catalog(**{f.name: getattr(self, f.name)[safe] for f in fields(self)})

    def to(self, device: torch.device | str) -> Catalog:
        return Catalog(**{f.name: getattr(self, f.name).to(device) for f in fields(self)})


@dataclass
class RequestInputs:
    """B requests with everything the user towers read."""

    cohort: torch.Tensor  # [B]
    age_bucket: torch.Tensor  # [B]
    gender: torch.Tensor  # [B]
    country: torch.Tensor  # [B]
    surface: torch.Tensor  # [B] serving context
    hour: torch.Tensor  # [B]
    platform: torch.Tensor  # [B]
    hist_item: torch.Tensor  # [B, L] ad rows, -1 = padding, most recent last
    hist_surface: torch.Tensor  # [B, L]
    hist_time: torch.Tensor  # [B, L] time buckets, 0 = padding
    organic: torch.Tensor  # [B, Lo] organic topics, -1 = padding

    def __len__(self) -> int:
        return len(self.cohort)

    def to(self, device: torch.device | str) -> RequestInputs:
        return RequestInputs(**{f.name: getattr(self, f.name).to(device) for f in fields(self)})

    def slice(self, lo: int, hi: int) -> RequestInputs:
        return RequestInputs(**{f.name: getattr(self, f.name)[lo:hi] for f in fields(self)})


def request_inputs(
    demographics: dict[str, np.ndarray],
    ts: np.ndarray,
    context: dict[str, np.ndarray],
    items: np.ndarray,
    hist_surface: np.ndarray,
    hist_ts: np.ndarray,
    organic: np.ndarray,
) -> RequestInputs:
    """Request inputs from arrays: demographics (cohort, age_bucket, gender, country codes) [B],
    context (surface, hour, platform) [B], right-aligned histories [B, L] padded with -1."""

    def t(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))

    return RequestInputs(
        **{k: t(v) for k, v in demographics.items()},
        **{k: t(v) for k, v in context.items()},
        hist_item=t(items),
        hist_surface=t(np.maximum(hist_surface, 0)),
        hist_time=t(time_buckets(ts[:, None] - hist_ts, items >= 0)),
        organic=t(organic),
    )


def make_requests(
    feats: Features,
    user: np.ndarray,
    ts: np.ndarray,
    surface: np.ndarray,
    hour: np.ndarray,
    platform: np.ndarray,
    max_len: int,
) -> RequestInputs:
    """Inputs of requests (user rows, times, context ids), as of each request's time."""
    user = np.asarray(user, dtype=np.int64)
    ts = np.asarray(ts, dtype=np.int64)
    items, hist_surface, hist_ts, _ = feats.history(user, ts, max_len)
    organic, _ = feats.organic_history(user, ts)
    u = feats.users
    demographics = {k: u[k][user] for k in ("cohort", "age_bucket", "gender", "country")}
    context = {"surface": surface, "hour": hour, "platform": platform}
    return request_inputs(demographics, ts, context, items, hist_surface, hist_ts, organic)


def inline_requests(
    feats: Features,
    cohort: np.ndarray,
    age_bucket: np.ndarray,
    gender: np.ndarray,
    country: np.ndarray,
    histories: list[tuple[np.ndarray, np.ndarray, np.ndarray]],
    organic: list[np.ndarray],
    ts: np.ndarray,
    surface: np.ndarray,
    hour: np.ndarray,
    platform: np.ndarray,
    max_len: int,
) -> RequestInputs:
    """Inputs of requests whose users are given inline rather than stored in `feats`.

    Demographics are vocabulary codes [B]; `histories[i]` = (ad rows, surface codes, Unix
    seconds) of user i's engagements in time order, `organic[i]` its organic topics in time
    order. As for stored users, only engagements strictly before the request time are seen.
    """
    n = len(ts)
    items = np.full((n, max_len), -1, dtype=np.int64)  # right-aligned, most recent last
    hist_surface = np.full((n, max_len), -1, dtype=np.int64)
    hist_ts = np.full((n, max_len), -1, dtype=np.int64)
    org_len = feats.config.organic_len
    org = np.full((n, org_len), -1, dtype=np.int64)
    for i, ((rows, surf, when), topics) in enumerate(zip(histories, organic, strict=True)):
        keep = when < ts[i]
        rows, surf, when = rows[keep][-max_len:], surf[keep][-max_len:], when[keep][-max_len:]
        if len(rows):
            items[i, -len(rows) :], hist_surface[i, -len(rows) :] = rows, surf
            hist_ts[i, -len(rows) :] = when
        topics = topics[-org_len:]
        if len(topics):
            org[i, -len(topics) :] = topics

    demographics = {
        "cohort": cohort,
        "age_bucket": age_bucket,
        "gender": gender,
        "country": country,
    }
    context = {"surface": surface, "hour": hour, "platform": platform}
    return request_inputs(demographics, ts, context, items, hist_surface, hist_ts, org)


def concat_requests(parts: list[RequestInputs], order: np.ndarray) -> RequestInputs:
    """Request inputs of several parts, concatenated and then taken in `order` ([B] positions)."""
    index = torch.from_numpy(np.asarray(order, dtype=np.int64))
    return RequestInputs(
        **{
            f.name: torch.cat([getattr(r, f.name) for r in parts])[index]
            for f in fields(RequestInputs)
        }
    )
