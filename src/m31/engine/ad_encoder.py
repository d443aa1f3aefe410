"""New ads -> rows of the ad table: the served model's ad tower applied to ads it never saw.

Shapes: n ads in one call, H text-embedding dim, d co-engagement dim, G gate-key dim, D value dim.

An ad arriving after training has its creative text, advertiser, objective, format, topic,
category and quality prior, but no co-engagement history: its co-engagement embedding is zero
(the cold-start input the tower also sees for ads without engagements). Its text is embedded
the way the training features were: with the sentence encoder (cached by content) when the
features had text embeddings, as zeros when they were built without. An objective or format the
model's vocabulary does not hold (a format first seen online) embeds as the unknown value, whose
embedding is zero: the tower reads no objective or format for that ad until a model trained on
it is served.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from m31.features import Features
from m31.model import Catalog, RetrievalModel


@dataclass(frozen=True)
class NewAd:
    """What the ad tower reads of an ad; the index's attributes are given beside it."""

    ad_id: int
    advertiser_id: int
    objective: str
    format: str
    topic: int
    category: int
    text: str
    quality: float = 0.0  # prior quality score, about N(0, 1) like the training catalogue's


class AdEncoder:
    def __init__(self, model: RetrievalModel, feats: Features, cache_dir=None) -> None:
        self.model = model
        self.text_dim = int(feats.text_emb.shape[1])
        self.cooc_dim = int(feats.cooc_emb.shape[1])
        self.with_text = bool(feats.config.text_embeddings)
        self.n_topics = int(feats.meta["n_topics"])
        self.n_categories = int(feats.meta["n_categories"])
        vocab = feats.meta["vocab"]
        self.codes = {
            name: {value: i for i, value in enumerate(vocab[name])}
            for name in ("objective", "format")
        }
        self.cache_dir = cache_dir

    def load_text_encoder(self) -> None:
        """Load the sentence encoder of new ads' texts now, not on the first ad (it takes
        seconds); nothing to load when the features have no text embeddings."""
        if self.with_text:
            from m31.features.text_encoder import load_encoder

            load_encoder()  # the device `embed_texts` encodes on

    @property
    def text_encoder_loaded(self) -> bool | None:
        """Whether the sentence encoder is loaded; None when texts are not encoded."""
        from m31.features.text_encoder import encoder_loaded

        return encoder_loaded() if self.with_text else None

    def check(self, ads: Sequence[NewAd], where: str = "ads") -> None:
        """Raise ValueError naming the first bad field (`where[i].field`)."""
        for i, a in enumerate(ads):
            if not 0 <= a.topic < self.n_topics:
                raise ValueError(f"{where}[{i}].topic: {a.topic} is outside 0..{self.n_topics - 1}")
            if not 0 <= a.category < self.n_categories:
                raise ValueError(
                    f"{where}[{i}].category: {a.category} is outside 0..{self.n_categories - 1}"
                )
            if not np.isfinite(a.quality):
                raise ValueError(f"{where}[{i}].quality: {a.quality} is not a finite number")

    def code(self, name: str, value: str) -> int:
        """`value`'s code in the model's vocabulary `name`; the unknown value's (one past the
        last) for one it does not hold."""
        codes = self.codes[name]
        return codes.get(value, len(codes))

    @torch.no_grad()
    def encode(self, ads: Sequence[NewAd]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(g [n, G], x [n, D], b [n]) fp32 on the model's device."""
        self.check(ads)
        n = len(ads)
        if self.with_text and n:
            from m31.features.embedding_cache import embed_texts

            text = embed_texts([a.text for a in ads], self.cache_dir)  # [n, H]
        else:
            text = np.zeros((n, self.text_dim), dtype=np.float32)
        device = next(self.model.parameters()).device

        def t(values, dtype=torch.int64) -> torch.Tensor:
            return torch.as_tensor(np.asarray(values), dtype=dtype, device=device)

        catalog = Catalog(
            ad_id=t([a.ad_id for a in ads]),
            advertiser=t([a.advertiser_id for a in ads]),  # external ids: the tower hashes them
            objective=t([self.code("objective", a.objective) for a in ads]),
            format=t([self.code("format", a.format) for a in ads]),
            topic=t([a.topic for a in ads]),
            category=t([a.category for a in ads]),
            quality=t([a.quality for a in ads], torch.float32),
            text_emb=t(text, torch.float32).reshape(n, self.text_dim),
            cooc_emb=torch.zeros(n, self.cooc_dim, device=device),
        )
        self.model.eval()
        return self.model.encode_ads(catalog)
