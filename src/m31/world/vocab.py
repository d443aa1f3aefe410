"""The topic vocabulary of the synthetic marketplace, and the ad texts and brand names made from it.

Topics form a two-level hierarchy: `N_CATEGORIES` top-level categories, each with
`LEAVES_PER_CATEGORY` leaf subtopics. A leaf topic id is
``category * LEAVES_PER_CATEGORY + leaf_index``, so ``topic // LEAVES_PER_CATEGORY`` is its
category.

Every leaf carries concrete product or service noun phrases and benefit phrases; every category
carries a few adjectives that suit all of its leaves, calls to action, and brand-name words. An
ad's creative text is one of a handful of English sentence templates filled from its leaf, e.g.
"Pro-grade trail running shoes that will keep you going mile after mile. Shop now.", so a
sentence encoder places ads of one leaf close together and ads of unrelated categories apart.

The categories, leaves and their words are data, `topics.json` beside this module (read at
import). Writing rules that keep every filled template grammatical: noun phrases are plural or mass
nouns (they follow "Discover", "Save on" and "Looking for" without an article), and benefit
phrases never need to agree with the noun's number ("that will ...", "so you can ...",
"built for ...", "with ...").

Text and name generation is vectorised: every random choice for all rows is drawn in a few numpy
calls, each row becomes one integer code of its choices, and only the distinct codes are turned
into strings. The number of distinct texts is bounded per leaf (templates x nouns x benefits x
adjectives x calls to action, about 1,000-2,000), which keeps a downstream embedding cache small.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources

import numpy as np

from m31.vocabularies import FORMATS


@dataclass(frozen=True)
class Leaf:
    name: str
    nouns: tuple[str, ...]  # plural or mass noun phrases: products and services
    benefits: tuple[str, ...]  # follow a noun phrase: "that will ...", "so you can ..."


@dataclass(frozen=True)
class Category:
    name: str
    adjectives: tuple[str, ...]  # fit every leaf of the category
    ctas: tuple[str, ...]  # calls to action for image ads
    brand_words: tuple[str, ...]  # capitalised words for advertiser names
    brand_suffixes: tuple[str, ...]  # "Athletics", "Travel", "Co."
    leaves: tuple[Leaf, ...]


def _load_categories() -> tuple[Category, ...]:
    """The categories, their leaves and words: package data (`topics.json`), read once."""
    text = resources.files("m31.world").joinpath("topics.json").read_text(encoding="utf-8")
    return tuple(
        Category(
            c["name"],
            tuple(c["adjectives"]),
            tuple(c["ctas"]),
            tuple(c["brand_words"]),
            tuple(c["brand_suffixes"]),
            tuple(
                Leaf(leaf["name"], tuple(leaf["nouns"]), tuple(leaf["benefits"]))
                for leaf in c["leaves"]
            ),
        )
        for c in json.loads(text)
    )


CATEGORIES: tuple[Category, ...] = _load_categories()

N_CATEGORIES = len(CATEGORIES)
LEAVES_PER_CATEGORY = 6
N_TOPICS = N_CATEGORIES * LEAVES_PER_CATEGORY

LEAVES: tuple[Leaf, ...] = tuple(leaf for cat in CATEGORIES for leaf in cat.leaves)
CATEGORY_NAMES: tuple[str, ...] = tuple(cat.name for cat in CATEGORIES)

# Calls to action by format; image ads take their category's own.
FORMAT_CTAS: dict[str, tuple[str, ...]] = {
    "video": ("Watch the video.",),
    "carousel": ("Swipe to see more.",),
}

# Sentence templates. `{Adj}` is the adjective with a capital first letter.
TEMPLATES: tuple[str, ...] = (
    "{Adj} {noun} {benefit}. {cta}",
    "Discover {adj} {noun} {benefit}. {cta}",
    "Save on {adj} {noun} {benefit}. {cta}",
    "Looking for {noun}? Explore our {adj} picks {benefit}. {cta}",
)

# Advertiser names. Shared words, coined-name syllables and the name patterns.
BRAND_GENERIC: tuple[str, ...] = (
    "Summit", "North", "Blue", "Bright", "Golden", "Oak", "River", "Harbor",
    "Silver", "Maple", "Cedar", "Evergreen", "True", "Bold", "Clear", "Red",
    "Stone", "Sun", "Wild", "Pine", "Alder", "Atlas", "Beacon", "Crest",
    "Meadow", "Willow", "Copper", "Hudson", "Sterling", "Juniper", "Ember", "Coastal",
)  # fmt: skip
BRAND_SYL_START: tuple[str, ...] = (
    "Ve", "Lu", "Ka", "Zo", "Mi", "No", "Ari", "Bel",
    "Cor", "Dal", "El", "Fen", "Ta", "Sol", "Ren", "Vi",
)  # fmt: skip
BRAND_SYL_END: tuple[str, ...] = (
    "ra", "lo", "na", "via", "tix", "ora", "ani", "ux", "ly", "ova", "ari", "eno",
)  # fmt: skip
# Name patterns: 0 "Summit Stride Athletics", 1 "Northpulse Fitness", 2 "Velora Travel",
# 3 "Oak & Kettle".
_N_NAME_PATTERNS = 4

_FORMAT_INDEX = {f: i for i, f in enumerate(FORMATS)}

assert all(len(c.leaves) == LEAVES_PER_CATEGORY for c in CATEGORIES)
assert all(f in _FORMAT_INDEX for f in FORMAT_CTAS)


def topic_names() -> list[str]:
    """Leaf names by topic id, "Category / Leaf"."""
    return [f"{cat.name} / {leaf.name}" for cat in CATEGORIES for leaf in cat.leaves]


def topic_category(topic_ids: np.ndarray) -> np.ndarray:
    """The category id of each leaf topic id (int64)."""
    t = _check_topics(topic_ids)
    return t // LEAVES_PER_CATEGORY


def _check_topics(topics: np.ndarray) -> np.ndarray:
    t = np.asarray(topics)
    if t.size and t.dtype.kind not in "iu":
        raise TypeError(f"topic ids must be integers, got dtype {t.dtype}")
    t = t.astype(np.int64, copy=False)
    if t.size and (t.min() < 0 or t.max() >= N_TOPICS):
        raise ValueError(f"topic ids must lie in [0, {N_TOPICS}), got {t.min()}..{t.max()}")
    return t


def _flat(groups: list[tuple[str, ...]]) -> tuple[list[str], np.ndarray, np.ndarray]:
    """Concatenate groups of phrases: the flat list, each group's offset and length."""
    counts = np.array([len(g) for g in groups], dtype=np.int64)
    offsets = np.zeros(len(groups), dtype=np.int64)
    np.cumsum(counts[:-1], out=offsets[1:])
    return [p for g in groups for p in g], offsets, counts


def _cap(s: str) -> str:
    return s[:1].upper() + s[1:]


class _Tables:
    """Flat phrase tables with per-topic (or per-category) offsets, built once."""

    def __init__(self) -> None:
        self.nouns, self.noun_off, self.noun_cnt = _flat([lf.nouns for lf in LEAVES])
        self.benefits, self.ben_off, self.ben_cnt = _flat([lf.benefits for lf in LEAVES])
        self.adjs, self.adj_off, self.adj_cnt = _flat([c.adjectives for c in CATEGORIES])
        self.adjs_cap = [_cap(a) for a in self.adjs]
        # CTAs per (category, format), row = category * len(FORMATS) + format.
        cta_groups = [FORMAT_CTAS.get(fmt, cat.ctas) for cat in CATEGORIES for fmt in FORMATS]
        self.ctas, self.cta_off, self.cta_cnt = _flat(cta_groups)
        self.words, self.word_off, self.word_cnt = _flat([c.brand_words for c in CATEGORIES])
        self.suffixes, self.suf_off, self.suf_cnt = _flat([c.brand_suffixes for c in CATEGORIES])


_TABLES: _Tables | None = None


def _tables() -> _Tables:
    global _TABLES
    if _TABLES is None:
        _TABLES = _Tables()
    return _TABLES


def _pick(u: np.ndarray, offsets: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Flat index of a uniform choice within each row's group, from uniforms u in [0, 1)."""
    return offsets + np.minimum((u * counts).astype(np.int64), counts - 1)


def _digits(codes: np.ndarray, radix: tuple[int, ...]) -> tuple[np.ndarray, list[np.ndarray]]:
    """Mixed-radix codes [n] taken apart: (what is left above the radix, the digits, last
    base's first)."""
    rest, digits = codes.copy(), []
    for base in reversed(radix):
        digits.append(rest % base)
        rest = rest // base
    return rest, digits


def _materialise(codes: np.ndarray, build) -> list[str]:
    """Strings for integer codes, building each distinct code's string once."""
    if codes.size == 0:
        return []
    uniq, inverse = np.unique(codes, return_inverse=True)
    strings = np.array(build(uniq), dtype=object)
    return strings[inverse.reshape(-1)].tolist()


def _format_index(formats: np.ndarray | None, n: int) -> np.ndarray:
    if formats is None:
        return np.zeros(n, dtype=np.int64)  # image: the category's own calls to action
    f = np.asarray(formats)
    if f.shape != (n,):
        raise ValueError(f"formats has shape {f.shape}, expected ({n},)")
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    if f.dtype.kind in "iu":
        fi = f.astype(np.int64)
        if fi.min() < 0 or fi.max() >= len(FORMATS):
            raise ValueError(f"format codes must lie in [0, {len(FORMATS)})")
        return fi
    names, inverse = np.unique(f.astype(str), return_inverse=True)
    unknown = [s for s in names.tolist() if s not in _FORMAT_INDEX]
    if unknown:
        raise ValueError(f"unknown ad formats {unknown}; expected one of {FORMATS}")
    lut = np.array([_FORMAT_INDEX[s] for s in names.tolist()], dtype=np.int64)
    return lut[inverse.reshape(-1)]


def make_texts(
    topics: np.ndarray, formats: np.ndarray | None, rng: np.random.Generator
) -> list[str]:
    """One creative text per leaf topic id in `topics`.

    `formats` (same length, optional) holds format names from `m31.vocabularies.FORMATS` or
    their integer codes; it picks the call to action ("Watch the video." for video). Without it
    every ad takes its category's image calls to action. The result depends only on the inputs
    and the state of `rng`, which advances by one fixed-size draw.
    """
    t = _check_topics(topics).reshape(-1)
    n = t.size
    f = _format_index(formats, n)
    tb = _tables()
    u = rng.random((5, n))  # template, noun, benefit, adjective, call to action
    cat = t // LEAVES_PER_CATEGORY
    tpl = np.minimum((u[0] * len(TEMPLATES)).astype(np.int64), len(TEMPLATES) - 1)
    noun = _pick(u[1], tb.noun_off[t], tb.noun_cnt[t])
    ben = _pick(u[2], tb.ben_off[t], tb.ben_cnt[t])
    adj = _pick(u[3], tb.adj_off[cat], tb.adj_cnt[cat])
    g = cat * len(FORMATS) + f
    cta = _pick(u[4], tb.cta_off[g], tb.cta_cnt[g])

    radix = (len(tb.nouns), len(tb.benefits), len(tb.adjs), len(tb.ctas))
    code = tpl
    for part, base in zip((noun, ben, adj, cta), radix, strict=True):
        code = code * base + part

    def build(uniq: np.ndarray) -> list[str]:
        rest, parts = _digits(uniq, radix)
        c_i, a_i, b_i, n_i = (p.tolist() for p in parts)
        return [
            TEMPLATES[k].format(
                Adj=tb.adjs_cap[a],
                adj=tb.adjs[a],
                noun=tb.nouns[nn],
                benefit=tb.benefits[b],
                cta=tb.ctas[c],
            )
            for k, nn, b, a, c in zip(rest.tolist(), n_i, b_i, a_i, c_i, strict=True)
        ]

    return _materialise(code, build)


def make_advertiser_names(categories: np.ndarray, rng: np.random.Generator) -> list[str]:
    """A plausible brand name per advertiser, flavoured by its category ("Summit Stride Athletics").

    Names may repeat across advertisers. Deterministic given `rng`'s state.
    """
    c = np.asarray(categories)
    if c.size and c.dtype.kind not in "iu":
        raise TypeError(f"category ids must be integers, got dtype {c.dtype}")
    c = c.astype(np.int64, copy=False).reshape(-1)
    if c.size and (c.min() < 0 or c.max() >= N_CATEGORIES):
        raise ValueError(f"category ids must lie in [0, {N_CATEGORIES})")
    n = c.size
    tb = _tables()
    u = rng.random((6, n))  # pattern, generic word, category word, suffix, two syllables
    pattern = np.minimum((u[0] * _N_NAME_PATTERNS).astype(np.int64), _N_NAME_PATTERNS - 1)
    gen = _pick(u[1], np.zeros(n, np.int64), np.full(n, len(BRAND_GENERIC), np.int64))
    word = _pick(u[2], tb.word_off[c], tb.word_cnt[c])
    suf = _pick(u[3], tb.suf_off[c], tb.suf_cnt[c])
    s1 = _pick(u[4], np.zeros(n, np.int64), np.full(n, len(BRAND_SYL_START), np.int64))
    s2 = _pick(u[5], np.zeros(n, np.int64), np.full(n, len(BRAND_SYL_END), np.int64))
    # Zero the parts a pattern does not use so that equal names share a code.
    gen = np.where(pattern == 2, 0, gen)
    word = np.where(pattern == 2, 0, word)
    suf = np.where(pattern == 3, 0, suf)
    s1 = np.where(pattern == 2, s1, 0)
    s2 = np.where(pattern == 2, s2, 0)

    radix = (
        len(BRAND_GENERIC),
        len(tb.words),
        len(tb.suffixes),
        len(BRAND_SYL_START),
        len(BRAND_SYL_END),
    )
    code = pattern
    for part, base in zip((gen, word, suf, s1, s2), radix, strict=True):
        code = code * base + part

    def one(p: int, g: int, w: int, s: int, a: int, b: int) -> str:
        if p == 0:
            return f"{BRAND_GENERIC[g]} {tb.words[w]} {tb.suffixes[s]}"
        if p == 1:
            return f"{BRAND_GENERIC[g]}{tb.words[w].lower()} {tb.suffixes[s]}"
        if p == 2:
            return f"{BRAND_SYL_START[a]}{BRAND_SYL_END[b]} {tb.suffixes[s]}"
        return f"{BRAND_GENERIC[g]} & {tb.words[w]}"

    def build(uniq: np.ndarray) -> list[str]:
        rest, parts = _digits(uniq, radix)
        b_i, a_i, s_i, w_i, g_i = (p.tolist() for p in parts)
        return [one(*row) for row in zip(rest.tolist(), g_i, w_i, s_i, a_i, b_i, strict=True)]

    return _materialise(code, build)
