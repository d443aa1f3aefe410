"""A printed summary of a dataset: counts, CTR, CVR, and breakdowns by surface and format."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc

from m31.data.dataset import Dataset


def _rates(table: pa.Table, by: str | None) -> list[dict]:
    if by is None:
        groups = [
            {
                "key": "all",
                "impressions": table.num_rows,
                "clicks": pc.sum(table["click"]).as_py() or 0,
                "conversions": pc.sum(table["conversion"]).as_py() or 0,
            }
        ]
    else:
        agg = table.group_by(by).aggregate(
            [("click", "count"), ("click", "sum"), ("conversion", "sum")]
        )
        groups = [
            {
                "key": r[by],
                "impressions": r["click_count"],
                "clicks": r["click_sum"],
                "conversions": r["conversion_sum"],
            }
            for r in agg.to_pylist()
        ]
        groups.sort(key=lambda g: -g["impressions"])
    for g in groups:
        g["ctr"] = g["clicks"] / g["impressions"] if g["impressions"] else 0.0
        g["cvr"] = g["conversions"] / g["clicks"] if g["clicks"] else 0.0
    return groups


def summarize(ds: Dataset) -> dict:
    """Counts and rates as plain data (what `print_summary` shows)."""
    events = ds.events
    ads = ds.ads
    status = ads.group_by("status").aggregate([("ad_id", "count")]).to_pylist()
    return {
        "source": ds.meta.get("source", "?"),
        "counts": ds.counts(),
        "campaigns": pc.count_distinct(ads["campaign_id"]).as_py(),
        "topics": len(ds.meta.get("topics", [])),
        "overall": _rates(events, None)[0],
        "by_surface": _rates(events, "surface"),
        "by_format": _rates(
            events.append_column(
                "format", pc.take(ads["format"], pc.index_in(events["ad_id"], ads["ad_id"]))
            ),
            "format",
        ),
        "ad_status": {r["status"]: r["ad_id_count"] for r in status},
        "events_per_user": events.num_rows / max(ds.users.num_rows, 1),
    }


def print_summary(ds: Dataset, console=None) -> dict:
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    s = summarize(ds)
    c = s["counts"]
    console.print(
        f"[bold]{s['source']} dataset[/bold]: {c['users']:,} users, {c['advertisers']:,} advertisers, "
        f"{s['campaigns']:,} campaigns, {c['ads']:,} ads over {s['topics']} topics; "
        f"{c['events']:,} events ({s['events_per_user']:.1f} per user), {c['organic']:,} organic engagements"
    )
    o = s["overall"]
    console.print(
        f"clicks {o['clicks']:,} (CTR {o['ctr']:.2%}), conversions {o['conversions']:,} "
        f"(CVR per click {o['cvr']:.2%}); ads by status: "
        + ", ".join(f"{k} {v:,}" for k, v in sorted(s["ad_status"].items()))
    )
    for title, rows in (("surface", s["by_surface"]), ("format", s["by_format"])):
        t = Table(title=f"by {title}", title_justify="left")
        for col in (title, "impressions", "CTR", "CVR"):
            t.add_column(col, justify="left" if col == title else "right")
        for r in rows:
            t.add_row(str(r["key"]), f"{r['impressions']:,}", f"{r['ctr']:.2%}", f"{r['cvr']:.2%}")
        console.print(t)
    return s
