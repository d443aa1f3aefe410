"""The dataset adapter of the index: an `AdIndex` over a dataset's ads table
(`AdIndex.from_table`, what `m31 index build` and the tests build from)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import torch

from m31.index.checks import shape_of
from m31.index.errors import AdIndexError

if TYPE_CHECKING:
    from m31.index.ad_index import AdIndex

# Columns of the dataset's ads table that `from_ads_table` keeps for filters.
TABLE_EXTRA_FIELDS: dict[str, str] = {
    "campaign_id": "int",
    "objective": "str",
    "format": "str",
    "topic": "int",
    "category": "int",
}


def from_ads_table(
    cls: type[AdIndex],
    ads: pa.Table,
    g: Any,
    x: Any,
    b: Any,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    capacity: int = 1024,
    targeting: Mapping[str, Sequence[str]] | None = None,
    extra_fields: Mapping[str, str] | None = None,
) -> AdIndex:
    """An `AdIndex` (`cls`) over the dataset's ads table (`m31.data.schema.ADS`), rows aligned
    with g, x, b.

    The schedule starts at `created_at` (null: open) and never ends; `tags` and
    `target_surfaces` are taken when the table has them and are empty otherwise, as are `bid`
    and `pacing` (null otherwise; checked as the index checks them). Nulls are
    kept as nulls (an open age bound, an ad without an advertiser, a filter that never
    matches). `targeting`: as `AdIndex`'s. `extra_fields`: more columns of the table to keep
    as filter fields, name -> kind (a dataset's `item_attributes`); one named `tags` or
    `target_surfaces` feeds that attribute.
    """
    renamed = {"schedule_start": "created_at"}  # index attribute -> ads table column
    kept = [
        "advertiser_id",
        "status",
        "target_countries",
        "target_age_min",
        "target_age_max",
        "target_genders",
        "target_platforms",
    ]
    optional = ["target_surfaces", "tags", "bid", "pacing", *TABLE_EXTRA_FIELDS]
    extra = dict(extra_fields or {})
    taken = sorted(set(extra) & {"ad_id", *renamed.values(), *kept, *TABLE_EXTRA_FIELDS})
    if taken:
        raise AdIndexError(f"extra field {taken[0]!r} is a column the index reads already")
    # Any other built-in attribute an extra field names is refused by the constructor.
    fed = {k for k, v in extra.items() if k in optional[:2] and v == "str_list"}
    fields = {**TABLE_EXTRA_FIELDS, **{k: v for k, v in extra.items() if k not in fed}}
    missing = [c for c in ["ad_id", *renamed.values(), *kept, *extra] if c not in ads.column_names]
    if missing:
        raise AdIndexError(f"ads table: missing column {missing[0]!r}")
    columns = {name: ads.column(col) for name, col in renamed.items()}
    columns |= {c: ads.column(c) for c in [*kept, *optional, *extra] if c in ads.column_names}
    g_shape, x_shape = shape_of(g), shape_of(x)
    if len(g_shape) != 2 or len(x_shape) != 2:
        raise AdIndexError(f"g and x must be 2-d, got shapes {list(g_shape)}, {list(x_shape)}")
    index = cls(
        g_shape[1],
        x_shape[1],
        device,
        dtype,
        max(capacity, ads.num_rows),
        extra_fields=fields,
        targeting=targeting,
    )
    index.upsert(ads.column("ad_id"), g, x, b, pa.table(columns))
    return index
