"""Eligibility as row bitmaps (DESIGN §4), in the spirit of the boolean-expression indexes of ad
serving (Whang et al., "Indexing Boolean Expressions", VLDB 2009): one bitmap of rows per
attribute value, kept up to date by every write, so that a request's mask is a few bytewise
AND / OR / NOT over N / 8 bytes rather than a pass over every attribute column.

Shapes: N rows, cap allocated, W = ceil(cap / 8) bytes per bitmap (ceil(N / 8) in a frozen
copy), V values of one field, C cached predicates, k rows in one write, B requests, U distinct
eligibility keys among them.

Layout: row r is bit r % 8 of byte r // 8 (`m31.ops.masks`, `numpy.packbits(bitorder="little")`),
so that read as int32 words (little-endian) row r is bit r % 32 of word r // 32, the layout of
the Triton kernel's own packed mask. A batch's masks leave as a `PackedMask` (`Eligibility.masks`:
one bitmap per key, one per request with exclusions, an index per request), which `score_topk`
takes as it is.

`Eligibility` keeps, beside an `AttributeTable` it does not own (`m31.index.attributes`):
* `live`: the rows not tombstoned;
* a family of bitmaps for each field of bounded vocabulary that every request reads (`FAMILIES`:
  status and the targeting lists): one per value, plus one for null or the empty list (for a
  targeting list, "no restriction");
* a bounded cache of predicates (`MAX_CACHED_BITMAPS`, oldest out) whose values are open or
  depend on the request: the leaves of filters (`m31.index.filters.Predicate`: tags, format,
  advertiser, ranges, ...), the ads' age range at one age, one blocked advertiser. A predicate
  is computed from the columns when first asked, then kept up to date by writes like the
  families;
* the schedule at one request second: a range check on the two int64 columns, kept until the
  next write.

A request's mask is `live & active & schedule(ts) & ages(age) & filter & AND over the targeting
lists of (empty | holds(value))`, evaluated against a `RequestContext`. Requests of a batch
with the same key (targeting context, second, filter) share one computation and one bitmap;
exclusions come last, per request. `m31.index.testing.reference_mask` is the definition from the
attribute columns that the bitmaps are tested against.

`AdIndex` (`m31.index.ad_index`) updates its `Eligibility` with every mutation and gives each
`frozen_view` a copy of it, made once per version like the copy of the attributes. A predicate
a copy had to compute is reported back to the index it was copied from, which adds it to its own
cache when it next makes a copy, so that the next version does not compute it again.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from m31.index.attributes import AttributeTable
from m31.index.filters import CompiledFilter, Node, Predicate, compile_filter
from m31.ops.masks import PackedMask, n_bytes, pack


@dataclass(frozen=True)
class RequestContext:
    """Who asks and where: what eligibility is evaluated against. None = unknown, which only
    ads without that restriction accept."""

    country: str | None
    age: int | None
    gender: str | None
    platform: str | None
    surface: str | None
    ts: int  # Unix seconds
    exclude_ads: Sequence[int] = ()  # e.g. already shown
    exclude_advertisers: Sequence[int] = ()  # e.g. blocked by the user


# Fields with a bitmap per value. Their vocabularies are bounded: closed ones, and at most 676
# two-letter country codes (`m31.index.limits.COUNTRY_CODE`).
TARGETING = {  # targeting list -> the `RequestContext` field it is matched against
    "target_countries": "country",
    "target_genders": "gender",
    "target_platforms": "platform",
    "target_surfaces": "surface",
}
FAMILIES = ("status", *TARGETING)

MAX_CACHED_BITMAPS = 128
"""Predicate bitmaps one `Eligibility` keeps (N / 8 bytes each; 1.25 MB at 10 M ads): enough
for every age of a user base plus the filters and blocked advertisers in use."""

MAX_SCHEDULES = 8  # request seconds whose schedule bitmap is kept until the next write
_CHUNK = 1 << 20  # rows per step of a large write, which bounds its [V, k] temporaries

Bitmap = torch.Tensor  # uint8 [W]
Fn = Callable[[Any], torch.Tensor]  # an AttributeTable (or AttributeRows) of n rows -> bool [n]


def _assign(bits: torch.Tensor, rows: torch.Tensor, match: torch.Tensor) -> None:
    """Set the bits of distinct rows [k] in bitmaps [V, W] to match [V, k] (bool), in place."""
    k = len(rows)
    if k == 0:
        return
    dev = bits.device
    first = int(rows[0])
    if (
        k > 64
        and int(rows[-1]) - first == k - 1
        and torch.equal(rows, torch.arange(first, first + k, device=dev))
    ):  # a run of rows, as an upsert appends: pack the run's bytes
        lead, span = first % 8, n_bytes(first % 8 + k)
        new = torch.zeros(match.shape[0], 8 * span, dtype=torch.bool, device=dev)  # [V, 8·span]
        new[:, lead : lead + k] = match
        keep = torch.ones(8 * span, dtype=torch.bool, device=dev)  # [8·span]
        keep[lead : lead + k] = False
        part = bits[:, first // 8 : first // 8 + span]  # [V, span]
        part.copy_((part & pack(keep)) | pack(new))
        return
    byte = rows // 8  # [k]
    bit = torch.ones(k, dtype=torch.int32, device=dev) << (rows % 8).to(torch.int32)  # [k]
    touched, where = torch.unique(byte, return_inverse=True)  # [u], [k]
    # The rows are distinct, so within one byte their bits are distinct and their sum is their OR.
    clear = torch.zeros(len(touched), dtype=torch.int32, device=dev).index_add_(0, where, bit)
    put = torch.zeros(match.shape[0], len(touched), dtype=torch.int32, device=dev)  # [V, u]
    put.index_add_(1, where, match.to(torch.int32) * bit)
    bits[:, touched] = (bits[:, touched] & ~clear.to(torch.uint8)) | put.to(torch.uint8)


def _ages(age: int | None) -> Fn:
    """The ads whose age range admits `age` (None: unknown, which only open ranges admit)."""

    def run(table) -> torch.Tensor:
        lo, has_lo = table.numeric("target_age_min")  # [n], [n]
        hi, has_hi = table.numeric("target_age_max")
        if age is None:
            return ~has_lo & ~has_hi
        return (~has_lo | (lo <= age)) & (~has_hi | (age <= hi))

    return run


def _scheduled(table, ts: int) -> torch.Tensor:
    """[n] bool: ads whose schedule holds second `ts` (a null bound is open)."""
    start, has_start = table.numeric("schedule_start")
    end, has_end = table.numeric("schedule_end")
    return (~has_start | (start <= ts)) & (~has_end | (ts < end))


def _key(request: RequestContext, filter_key: Hashable) -> Hashable:
    """What requests that share one eligibility bitmap have in common: the targeting context,
    the second and the filter (not the exclusions, which come after)."""
    r = request
    return (r.country, r.age, r.gender, r.platform, r.surface, int(r.ts), filter_key)


class _Family:
    """The bitmaps of one field by value: row 0 for null (a str field) or the empty list, row
    1 + c for the value of code c in the table the family follows."""

    def __init__(self, width: int, device: torch.device):
        self.bits = torch.zeros(1, width, dtype=torch.uint8, device=device)  # [1 + V (cap), W]
        self.rows: dict[str, int] = {}  # value -> its row in `bits`

    def follow(self, words: Sequence[str]) -> int:
        """Add rows for the values the table added since; the number of rows in use."""
        for w in words[len(self.rows) :]:
            self.rows[w] = 1 + len(self.rows)
        used = 1 + len(self.rows)
        if used > len(self.bits):
            grown = torch.zeros(
                max(used, 2 * len(self.bits)),
                self.bits.shape[1],
                dtype=torch.uint8,
                device=self.bits.device,
            )  # [1 + V (cap), W]
            grown[: len(self.bits)] = self.bits
            self.bits = grown
        return used

    def get(self, word: str | None) -> Bitmap | None:
        row = self.rows.get(word) if word is not None else None
        return None if row is None else self.bits[row]


class Eligibility:
    """Bitmaps of the rows of one index (see the module docstring); not thread-safe: its index
    calls it under its lock, or on a frozen copy that only that copy's view reads."""

    def __init__(self, device: torch.device, capacity: int):
        self.device = torch.device(device)
        self.width = n_bytes(capacity)
        self.live = torch.zeros(self.width, dtype=torch.uint8, device=self.device)  # [W]
        self._families = {name: _Family(self.width, self.device) for name in FAMILIES}
        self._cache = torch.zeros(0, self.width, dtype=torch.uint8, device=self.device)  # [C, W]
        self._slots: OrderedDict[Hashable, int] = OrderedDict()  # key -> row of `_cache`
        self._fns: dict[Hashable, Fn] = {}  # key -> how to compute it
        self._schedules: dict[int, Bitmap] = {}  # request second -> its schedule bitmap
        self._origin: Eligibility | None = None  # the index's own, for a frozen copy
        self._asked: dict[Hashable, Fn] = {}  # predicates frozen copies had to compute
        self._asked_lock = threading.Lock()  # copies report from their readers' threads
        self.key_masks = 0  # eligibility keys computed so far (what grouping saves)

    # ---- writes (under the index's lock) ---------------------------------------------------

    def reserve(self, capacity: int) -> None:
        width = n_bytes(capacity)
        if width <= self.width:
            return

        def grow(t: torch.Tensor) -> torch.Tensor:
            out = torch.zeros(*t.shape[:-1], width, dtype=t.dtype, device=t.device)
            out[..., : self.width] = t
            return out

        self.live = grow(self.live)
        for family in self._families.values():
            family.bits = grow(family.bits)
        self._cache = grow(self._cache)
        self._schedules.clear()
        self.width = width

    def set_live(self, rows: torch.Tensor, alive: bool) -> None:
        match = torch.full((1, len(rows)), alive, dtype=torch.bool, device=self.device)
        _assign(self.live[None], rows, match)

    def write(self, rows: torch.Tensor, attrs: AttributeTable, fields=None) -> None:
        """Follow `attrs` after it wrote the distinct rows [k] (`fields`: only these changed;
        the cached predicates are evaluated again on the rows whatever they read)."""
        self._schedules.clear()
        for lo in range(0, len(rows), _CHUNK):
            self._write(rows[lo : lo + _CHUNK], attrs, fields)

    def _write(self, rows: torch.Tensor, attrs: AttributeTable, fields) -> None:
        view, k = attrs.rows(rows), len(rows)
        for name, family in self._families.items():
            if fields is not None and name not in fields:
                continue
            used = family.follow(attrs.vocabulary(name))
            if attrs.schema[name] == "str":
                codes = view.codes(name) + 1  # [k], 0 for null
                match = codes[None] == torch.arange(used, device=self.device)[:, None]  # [V, k]
            else:
                codes, count = view.lists(name)  # [m], [k]
                match = torch.zeros(used, k, dtype=torch.bool, device=self.device)  # [V, k]
                match[0] = count == 0
                owner = torch.repeat_interleave(
                    torch.arange(k, device=self.device), count, output_size=len(codes)
                )  # [m]
                match[codes.long() + 1, owner] = True
            _assign(family.bits[:used], rows, match)
        if self._slots:
            slots = torch.tensor(list(self._slots.values()), device=self.device)  # [C]
            match = torch.stack([self._fns[key](view) for key in self._slots])  # [C, k]
            part = self._cache[slots]  # [C, W]
            _assign(part, rows, match)
            self._cache[slots] = part

    # ---- predicates ------------------------------------------------------------------------

    def _cached(self, key: Hashable, fn: Fn, attrs: AttributeTable, n: int) -> Bitmap:
        slot = self._slots.get(key)
        if slot is not None:
            return self._cache[slot]
        bits = self._store(key, fn, fn(attrs), n)
        if self._origin is not None:
            with self._origin._asked_lock:
                self._origin._asked[key] = fn
        return bits

    def _store(self, key: Hashable, fn: Fn, mask: torch.Tensor, n: int) -> Bitmap:
        if len(self._slots) >= MAX_CACHED_BITMAPS:
            oldest, slot = self._slots.popitem(last=False)
            del self._fns[oldest]
        elif len(self._slots) < len(self._cache):
            slot = len(self._slots)
        else:
            slot = len(self._cache)
            grown = torch.zeros(
                min(MAX_CACHED_BITMAPS, max(1, 2 * slot)),
                self.width,
                dtype=torch.uint8,
                device=self.device,
            )  # [C (cap), W]
            grown[:slot] = self._cache
            self._cache = grown
        self._cache[slot] = 0
        self._cache[slot, : n_bytes(n)] = pack(mask)
        self._slots[key], self._fns[key] = slot, fn
        return self._cache[slot]

    def adopt(self, attrs: AttributeTable, n: int) -> None:
        """Cache the predicates frozen copies had to compute, from the current `attrs`."""
        with self._asked_lock:
            asked, self._asked = self._asked, {}
        for key, fn in asked.items():
            if key not in self._slots:
                self._store(key, fn, fn(attrs), n)

    def copy(self, n: int) -> Eligibility:
        """A copy of the bitmaps of rows 0..n-1, for a frozen view of this version."""
        out = Eligibility.__new__(Eligibility)
        out.device, out.width = self.device, n_bytes(n)
        out.live = self.live[: out.width].clone()
        out._families = {}
        for name, family in self._families.items():
            copied = _Family.__new__(_Family)
            copied.bits = family.bits[: 1 + len(family.rows), : out.width].clone()
            copied.rows = dict(family.rows)
            out._families[name] = copied
        out._cache = self._cache[:, : out.width].clone()
        out._slots, out._fns = OrderedDict(self._slots), dict(self._fns)
        out._schedules = {}
        out._origin, out._asked, out._asked_lock = self, {}, threading.Lock()
        out.key_masks = 0
        return out

    # ---- masks -----------------------------------------------------------------------------

    def _schedule(self, ts: int, attrs: AttributeTable, n: int) -> Bitmap:
        bits = self._schedules.get(ts)
        if bits is None:
            if len(self._schedules) >= MAX_SCHEDULES:
                self._schedules.pop(next(iter(self._schedules)))
            bits = torch.zeros(self.width, dtype=torch.uint8, device=self.device)  # [W]
            bits[: n_bytes(n)] = pack(_scheduled(attrs, ts))
            self._schedules[ts] = bits
        return bits

    def _filter(self, node: Node, attrs: AttributeTable, n: int) -> Bitmap:
        if isinstance(node, Predicate):
            return self._cached(node.key, node.run, attrs, n)
        op, arg = node
        if op == "not":
            return ~self._filter(arg, attrs, n)
        if not arg:  # all() holds everywhere, any() nowhere
            fill = 0xFF if op == "all" else 0
            return torch.full((self.width,), fill, dtype=torch.uint8, device=self.device)
        bits = self._filter(arg[0], attrs, n).clone()
        for child in arg[1:]:
            if op == "all":
                bits &= self._filter(child, attrs, n)
            else:
                bits |= self._filter(child, attrs, n)
        return bits

    def key_bits(
        self,
        request: RequestContext,
        filter_fn: CompiledFilter | None,
        attrs: AttributeTable,
        n: int,
    ) -> Bitmap:
        """[W] the rows eligible for `request` and `filter_fn`, before the request's
        exclusions."""
        self.key_masks += 1
        active = self._families["status"].get("active")
        if active is None:
            return torch.zeros(self.width, dtype=torch.uint8, device=self.device)
        bits = self.live & active
        bits &= self._schedule(int(request.ts), attrs, n)
        age = None if request.age is None else int(request.age)
        bits &= self._cached(("ages", age), _ages(age), attrs, n)
        for name, asked in TARGETING.items():
            family = self._families[name]
            held = family.get(getattr(request, asked))
            bits &= family.bits[0] if held is None else family.bits[0] | held
        if filter_fn is not None:
            bits &= self._filter(filter_fn.node, attrs, n)
        return bits

    def blocked(self, advertisers: Sequence[int], attrs: AttributeTable, n: int) -> Bitmap:
        """[W] the rows of the given advertisers: one predicate for them all, so that a long
        list costs one pass over the column and one cache slot, not one of each per advertiser."""
        leaf = compile_filter(
            {"in": ["advertiser_id", [int(a) for a in advertisers]]}, attrs.schema
        ).node
        return self._cached(leaf.key, leaf.run, attrs, n)

    def masks(
        self,
        requests: Sequence[RequestContext],
        filters: Sequence[CompiledFilter | None],
        attrs: AttributeTable,
        row_ids: torch.Tensor,
        n: int,
    ) -> PackedMask:
        """Each `RequestContext` with its filter, exclusions included, as bitmaps: requests with
        the same key share one computation and one bitmap, and a request that excludes
        advertisers or ads gets its own."""
        keys: dict[Hashable, int] = {}  # eligibility key -> its bitmap
        maps: list[Bitmap] = []
        which: list[int] = []
        for request, filter_fn in zip(requests, filters, strict=True):
            f_key = None if filter_fn is None else filter_fn.key
            key = _key(request, f_key)
            if key not in keys:
                keys[key] = len(maps)
                maps.append(self.key_bits(request, filter_fn, attrs, n))
            which.append(keys[key])
        for r, request in enumerate(requests):
            if not len(request.exclude_advertisers) and not len(request.exclude_ads):
                continue
            own = maps[which[r]]
            if len(request.exclude_advertisers):
                own = own & ~self.blocked(request.exclude_advertisers, attrs, n)
            if len(request.exclude_ads):
                # By id over the rows, not through an id -> row map, so that a frozen view needs
                # no copy of that map; rows of other versions of an ad are not live anyway.
                excluded = torch.tensor(
                    [int(a) for a in request.exclude_ads], dtype=torch.int64, device=self.device
                )
                hit = torch.zeros(self.width, dtype=torch.uint8, device=self.device)  # [W]
                hit[: n_bytes(n)] = pack(torch.isin(row_ids[:n], excluded))
                own = own & ~hit
            which[r] = len(maps)
            maps.append(own)
        empty = torch.zeros(0, self.width, dtype=torch.uint8, device=self.device)
        bits = torch.stack(maps) if maps else empty  # [U, W]
        return PackedMask(bits, torch.tensor(which, dtype=torch.int64, device=self.device), n)
