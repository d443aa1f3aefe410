"""Memory of the attribute table per distinct list value, and the cost of a targeting mask.

    m31 bench attribute-memory [--ads 50000] [--new-tags 1000] [--device cpu] [--threads 1]

Builds an `AdIndex` of --ads ads (1-3 countries, genders, platforms, 0-3 tags out of 200 each)
with room for more rows, and prints its attribute tensors' bytes, then those of:

* the same ads, except that --new-tags of their tags are renamed to values no other ad holds:
  the same data with more distinct values, so the difference is what distinct values cost;
* after one upsert of ads carrying --new-tags new distinct tags (10 per ad): what such an
  upsert adds. Buffers grow geometrically, so this includes whatever one-off growth the upsert
  triggers (amortised over the appends that follow);

then the host memory (Python objects, traced) one distinct value costs a serving index: the
same ads upserted in 20 calls with new tags and with tags the index holds, a frozen view (what
a request reads) taken after each call and the last two kept, as readers keep them;

then the median time of one request's eligibility mask (targeting on four list fields) and of
a `contains` filter on tags, on --threads CPU threads (one times steadily on a shared machine).

Run it against another checkout to compare: PYTHONPATH=OTHER/src python -m m31.bench
attribute-memory
"""

from __future__ import annotations

import tracemalloc

import numpy as np
import torch

from m31.bench.common import median_ms
from m31.bench.results import Figure
from m31.index import AdIndex, RequestContext, compile_filter
from m31.vocabularies import GENDERS, PLATFORMS
from m31.world.generate import COUNTRIES

TAGS_PER_NEW_AD = 10


def tensor_bytes(obj, seen: set[int] | None = None) -> int:
    """Bytes of the tensor storages reachable from `obj` through attributes and containers,
    each storage counted once (views share theirs)."""
    seen = set() if seen is None else seen
    if isinstance(obj, torch.Tensor):
        storage = obj.untyped_storage()
        if storage.data_ptr() in seen:
            return 0
        seen.add(storage.data_ptr())
        return storage.nbytes()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v, seen) for v in obj.values())
    if isinstance(obj, list | tuple):
        return sum(tensor_bytes(v, seen) for v in obj if not isinstance(v, str))
    if hasattr(obj, "__dict__"):
        return tensor_bytes(vars(obj), seen)
    return 0


def pick(rng: np.random.Generator, words: tuple[str, ...], lo: int, hi: int) -> list[str]:
    return sorted(rng.choice(words, rng.integers(lo, hi + 1), replace=False).tolist())


def host_bytes_per_value(build, base: list[dict], ad, start: int, n_new: int) -> float:
    """Traced host bytes per distinct tag value: upserts of `n_new` ads with new tags, minus
    the same upserts with tags the index holds, each followed by a frozen view."""
    grown = []
    for new_tags in (True, False):
        index = build(base)
        views = [index.frozen_view()]
        tracemalloc.start()
        first = tracemalloc.get_traced_memory()[0]
        calls = np.array_split(np.arange(start, start + n_new), 20)
        for call in calls:
            attrs = [
                ad(int(i), [f"v-{i}-{j}" for j in range(TAGS_PER_NEW_AD)] if new_tags else [])
                for i in call
            ]
            zeros = np.zeros((len(call), 8), dtype=np.float32)
            index.upsert(call, zeros, zeros, zeros[:, 0], attrs)
            views = [*views[-1:], index.frozen_view()]
        grown.append(tracemalloc.get_traced_memory()[0] - first)
        tracemalloc.stop()
    return (grown[0] - grown[1]) / (n_new * TAGS_PER_NEW_AD)


def run(ads: int, new_tags: int, device: str, threads: int) -> list[Figure]:
    """`m31 bench attribute-memory`: the measurements above, printed; the figures."""
    torch.set_num_threads(threads)
    rng = np.random.default_rng(0)
    tags = tuple(f"tag-{i}" for i in range(200))
    n_new = -(-new_tags // TAGS_PER_NEW_AD)
    capacity = 1 << (ads + n_new - 1).bit_length()  # no row growth during the bench

    def ad(i: int, ad_tags: list[str]) -> dict:
        return {
            "advertiser_id": i % 997,
            "target_countries": pick(rng, COUNTRIES, 1, 3),
            "target_genders": pick(rng, GENDERS, 0, 1),
            "target_platforms": pick(rng, PLATFORMS, 0, 2),
            "tags": ad_tags,
        }

    base = [ad(i, pick(rng, tags, 0, 3)) for i in range(ads)]
    renamed = [dict(a) for a in base]
    with_tags = [i for i, a in enumerate(base) if a["tags"]][:new_tags]
    for j, i in enumerate(with_tags):
        renamed[i]["tags"] = sorted([f"renamed-{j}", *base[i]["tags"][1:]])

    def build(attrs: list[dict]) -> AdIndex:
        index = AdIndex(8, 8, device, torch.float32, capacity=capacity)
        zeros = np.zeros((len(attrs), 8), dtype=np.float32)
        index.upsert(np.arange(len(attrs)), zeros, zeros, zeros[:, 0], attrs)
        return index

    index = build(base)
    before = tensor_bytes(index._attrs)
    more_values = tensor_bytes(build(renamed)._attrs)

    new_ids = np.arange(ads, ads + n_new)
    fresh = [f"new-{j}" for j in range(n_new * TAGS_PER_NEW_AD)]
    attrs = [
        ad(int(i), fresh[k * TAGS_PER_NEW_AD : (k + 1) * TAGS_PER_NEW_AD])
        for k, i in enumerate(new_ids)
    ]
    zeros = np.zeros((n_new, 8), dtype=np.float32)
    index.upsert(new_ids, zeros, zeros, zeros[:, 0], attrs)
    after = tensor_bytes(index._attrs)

    per_value = host_bytes_per_value(build, base, ad, ads, n_new)

    request = RequestContext("DE", 30, "F", "web", None, ts=0)
    mask_ms = median_ms(lambda: index.eligible_mask(request), 30)
    tag_filter = compile_filter({"contains": ["tags", "tag-7"]}, index.schema)
    contains_ms = median_ms(lambda: tag_filter(index._attrs), 30)

    print(f"{ads:,} ads, capacity {capacity:,}, device {device}")
    print(f"{'attribute tensors':<46} {before / 2**20:10.2f} MiB")
    print(
        f"{f'same ads, {len(with_tags):,} tags renamed to new values':<46} "
        f"{more_values / 2**20:10.2f} MiB  ({(more_values - before) / 2**10:+,.1f} KiB)"
    )
    print(
        f"{f'after upserting {n_new} ads, {len(fresh):,} new tags':<46} "
        f"{after / 2**20:10.2f} MiB  ({(after - before) / 2**10:+,.1f} KiB)"
    )
    print(f"{'host memory per distinct value (traced)':<46} {per_value:10.0f} B")
    print(f"{'eligibility mask (1 request)':<46} {mask_ms:10.3f} ms")
    print(f"{'contains filter on tags':<46} {contains_ms:10.3f} ms")
    case = f"ads={ads} new_tags={new_tags} device={device} threads={threads}"
    return [
        Figure("attribute-memory", case, "base", "attribute_bytes", before, "B"),
        Figure("attribute-memory", case, "tags renamed", "attribute_bytes", more_values, "B"),
        Figure("attribute-memory", case, "new tags upserted", "attribute_bytes", after, "B"),
        Figure("attribute-memory", case, "host", "bytes_per_distinct_value", per_value, "B"),
        Figure("attribute-memory", case, "eligibility mask", "median_ms", mask_ms, "ms"),
        Figure("attribute-memory", case, "contains filter", "median_ms", contains_ms, "ms"),
    ]
