"""Bounds on list attributes, so that no input can make the index's memory grow without limit.

An upsert or attribute update beyond one of them is refused with an `AdIndexError` that names
the ad and the field, before anything is logged or applied.
"""

from __future__ import annotations

MAX_LIST_VALUES = 64
"""Values one ad may hold in a free-form list field (`tags`, and list fields an index is given
as `extra_fields`). Targeting lists are bounded by their vocabularies instead."""

MAX_VALUE_CHARS = 64
"""Characters in one value of a free-form list field."""

MAX_VOCABULARY = 100_000
"""Distinct values of one list field across the index's rows, tombstoned rows included until
`compact()` drops the values no ad holds any more. Each costs about 130 bytes of host memory
(the string, its vocabulary entry and list slot, shared by the frozen views every version makes;
`m31 bench attribute-memory`, 20-character values), and each of its occurrences 8 bytes on the
index's device (plus the room its buffers grow into). A server's resident memory grows by more than the index holds, as the allocator
keeps what parsing the upsert calls freed (an outside measurement saw about 550 bytes per value
over 60,000 values, before the views shared the vocabularies)."""

COUNTRY_FIELDS = ("target_countries",)
"""List fields whose values are ISO 3166-1 alpha-2 country codes, in ads and in filters."""

COUNTRY_CODE = r"[A-Z]{2}"
"""The shape of a country code: two uppercase ASCII letters ("US", "DE"). Only the shape is
checked, so codes assigned after this release are accepted; at most 676 exist."""
