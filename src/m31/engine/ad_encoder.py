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

Its item attributes (the dataset's declared str and str_list columns the features made tokens
of, `m31.features.attributes`) become the same tokens as in training; a value the model never
saw still hashes into its table, whose row it then reads untrained.

What an ad lacks (None) is no input, as a null is in the training catalogue
(`m31.features.build`): no advertiser (a zero advertiser embedding), the unknown objective,
format, topic or category (zero rows), no text (a zero text embedding; the encoder never sees a
made-up sentence), quality 0 (the prior's mean).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from m31.features import Features
from m31.features.attributes import attribute_tokens
from m31.model import Catalog, RetrievalModel
from m31.model.inputs import NO_ADVERTISER


@dataclass(frozen=True)
class NewAd:
    """What the ad tower reads of an ad; the index's attributes are given beside it."""

    ad_id: int
    advertiser_id: int | None  # None: an ad without an advertiser
    objective: str | None
    format: str | None
    topic: int | None
    category: int | None
    text: str | None
    quality: float | None = 0.0  # prior quality score, about N(0, 1) like the training
    # catalogue's; None: unknown, read as 0
    # the item attributes the features made tokens of (meta `attribute_tokens`), column ->
    # value (a str, a list of str, or None); a column it lacks is None: no tokens from it
    attributes: Mapping[str, Any] | None = None


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
        self.attribute_kinds: dict[str, str] = dict(feats.meta.get("attribute_tokens") or {})

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
            for name, n in (("topic", self.n_topics), ("category", self.n_categories)):
                value = getattr(a, name)
                if value is not None and not 0 <= value < n:
                    known = f"0..{n - 1}" if n else f"none: the model has no {name}s"
                    raise ValueError(f"{where}[{i}].{name}: {value} is outside {known}")
            if a.quality is not None and not np.isfinite(a.quality):
                raise ValueError(f"{where}[{i}].quality: {a.quality} is not a finite number")

    def code(self, name: str, value: str | None) -> int:
        """`value`'s code in the model's vocabulary `name`; the unknown value's (one past the
        last) for None or one it does not hold."""
        codes = self.codes[name]
        return codes.get(value, len(codes))

    def tokens(self, ads: Sequence[NewAd]) -> np.ndarray:
        """[n, T] the ads' item-attribute tokens, as the features make them."""
        columns = {
            name: [(a.attributes or {}).get(name) for a in ads] for name in self.attribute_kinds
        }
        return attribute_tokens(columns, self.attribute_kinds, len(ads))

    @torch.no_grad()
    def encode(self, ads: Sequence[NewAd]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(g [n, G], x [n, D], b [n]) fp32 on the model's device."""
        self.check(ads)
        n = len(ads)
        text = np.zeros((n, self.text_dim), dtype=np.float32)  # [n, H]: no text is zeros
        has_text = [i for i, a in enumerate(ads) if a.text is not None]
        if self.with_text and has_text:
            from m31.features.embedding_cache import embed_texts

            text[has_text] = embed_texts([ads[i].text for i in has_text], self.cache_dir)
        device = next(self.model.parameters()).device

        def t(values, dtype=torch.int64) -> torch.Tensor:
            return torch.as_tensor(np.asarray(values), dtype=dtype, device=device)

        catalog = Catalog(
            ad_id=t([a.ad_id for a in ads]),
            # external ids: the tower hashes them
            advertiser=t(
                [NO_ADVERTISER if a.advertiser_id is None else a.advertiser_id for a in ads]
            ),
            objective=t([self.code("objective", a.objective) for a in ads]),
            format=t([self.code("format", a.format) for a in ads]),
            topic=t([self.n_topics if a.topic is None else a.topic for a in ads]),
            category=t([self.n_categories if a.category is None else a.category for a in ads]),
            quality=t([a.quality or 0.0 for a in ads], torch.float32),
            text_emb=t(text, torch.float32).reshape(n, self.text_dim),
            cooc_emb=torch.zeros(n, self.cooc_dim, device=device),
            attributes=t(self.tokens(ads)),
        )
        self.model.eval()
        return self.model.encode_ads(catalog)
