"""The on-disk format of an ad index snapshot (DESIGN §4, "Snapshots on disk"): the folder
`AdIndex.save` writes and `AdIndex.load` reads, read by numpy and pyarrow alone.

`write` makes the folder atomically from the arrays, attributes and manifest an index gives it;
`read` checks the manifest against every file and gives them back; `read_manifest` is the
validated manifest alone (the durable index and the cluster read it to choose a snapshot).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from m31.files import WriteRefused, write_folder_atomic
from m31.index.ad_table import TABLE_DTYPES
from m31.index.columns import BASE_FIELDS, KINDS, LATER_FIELDS
from m31.index.errors import AdIndexError

FORMAT = "m31.ad_index"
FORMAT_VERSION = 1
# bf16 and fp16 tables are stored as float32 .npy (exact: both are subsets of float32), so
# that numpy alone reads a snapshot; the manifest's "dtype" says what to cast back to. An int8
# table is stored as its codes and per-row scales, so a snapshot reloads to the same bytes.
_NPY = {"g": np.float32, "x": np.float32, "b": np.float32, "ids": np.int64}
_NPY_INT8 = {
    "g": np.int8,
    "g_scale": np.float32,
    "x": np.int8,
    "x_scale": np.float32,
    "b": np.float32,
    "ids": np.int64,
}


def npy_files(dtype: str) -> dict[str, type]:
    """The arrays of a snapshot of this table dtype: name -> numpy dtype."""
    return _NPY_INT8 if dtype == "int8" else _NPY


def write(
    path: Path,
    arrays: dict[str, np.ndarray],
    attributes: pa.Table,
    manifest: dict,
    overwrite: bool = False,
    beside: Callable[[Path], None] | None = None,
) -> Path:
    """Create the snapshot folder `path` atomically: `arrays` (name -> array, `npy_files`),
    `attributes` and `manifest` (every key but format, format_version and files, which this
    adds); `beside(folder)` may add a subfolder of its own before the rename (not listed)."""
    manifest = {"format": FORMAT, "format_version": FORMAT_VERSION, **manifest}
    assert {k: a.dtype for k, a in arrays.items()} == npy_files(manifest["dtype"])

    def fill(tmp: Path) -> None:
        for name, arr in arrays.items():
            np.save(tmp / f"{name}.npy", arr)
        pq.write_table(attributes, tmp / "attributes.parquet")
        files = sorted(p.name for p in tmp.iterdir())
        manifest["files"] = {f: {"bytes": (tmp / f).stat().st_size} for f in files}
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
        if beside is not None:
            beside(tmp)

    try:
        return write_folder_atomic(Path(path), fill, overwrite=overwrite)
    except WriteRefused as e:
        raise AdIndexError(str(e)) from e


def read(path: Path) -> tuple[dict, dict[str, np.ndarray], pa.Table]:
    """(manifest, arrays, attributes) of the snapshot folder `path`, each checked against the
    manifest (shapes, dtypes, rows, columns); AdIndexError naming the file otherwise."""
    path = Path(path)
    manifest = read_manifest(path)
    count, dims = manifest["count"], {"g": manifest["dim_g"], "x": manifest["dim_x"]}
    arrays = {}
    for name, dtype in npy_files(manifest["dtype"]).items():
        file = path / f"{name}.npy"
        try:
            arr = np.load(file, allow_pickle=False)
        except (OSError, ValueError) as e:
            raise AdIndexError(f"{file}: unreadable ({e})") from e
        shape = (count, dims[name]) if name in dims else (count,)
        if arr.shape != shape or arr.dtype != dtype:
            raise AdIndexError(
                f"{file}: {arr.dtype} {list(arr.shape)} does not match the manifest "
                f"({np.dtype(dtype)} {list(shape)})"
            )
        arrays[name] = arr
    file = path / "attributes.parquet"
    try:
        attributes = pq.read_table(file)
    except (OSError, pa.ArrowInvalid) as e:
        raise AdIndexError(f"{file}: unreadable ({e})") from e
    if attributes.num_rows != count or attributes.column_names != list(manifest["fields"]):
        raise AdIndexError(
            f"{file}: {attributes.num_rows} rows with columns {attributes.column_names} do "
            f"not match the manifest ({count} rows, fields {list(manifest['fields'])})"
        )
    return manifest, arrays, attributes


def read_manifest(path: str | Path) -> dict:
    """The validated `manifest.json` of a snapshot folder.

    Layout: `manifest.json` (format, format_version, index_version, dim_g, dim_x, dtype, count,
    model_hash, fields = attribute name -> kind, files = name -> {"bytes": size}), `g.npy`
    [count, dim_g], `x.npy` [count, dim_x], `b.npy` [count] (float32 whatever `dtype` is: bf16
    and fp16 values are exact in float32; for int8, g and x are the int8 codes and
    `g_scale.npy`, `x_scale.npy` [count] float32 their row scales), `ids.npy` [count] int64,
    `attributes.parquet` (one row per ad, in the same order; list columns are sets).
    """
    path = Path(path)
    file = path / "manifest.json"
    if not file.is_file():
        raise AdIndexError(f"{file}: missing (not an index snapshot?)")
    try:
        manifest = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise AdIndexError(f"{file}: not valid JSON ({e})") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise AdIndexError(f"{file}: not an {FORMAT} manifest")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise AdIndexError(
            f"{file}: format_version {manifest.get('format_version')!r}, this m31 reads "
            f"{FORMAT_VERSION}"
        )
    types = {
        "index_version": int,
        "dim_g": int,
        "dim_x": int,
        "count": int,
        "dtype": str,
        "fields": dict,
        "files": dict,
    }
    for key, t in types.items():
        if not isinstance(manifest.get(key), t) or isinstance(manifest.get(key), bool):
            raise AdIndexError(f"{file}: {key!r} missing or not a {t.__name__}")
    if manifest["dtype"] not in TABLE_DTYPES:
        raise AdIndexError(f"{file}: dtype {manifest['dtype']!r} not one of {list(TABLE_DTYPES)}")
    fields = manifest["fields"]
    lacks = [k for k, v in BASE_FIELDS.items() if fields.get(k) != v]
    if any(k not in LATER_FIELDS or k in fields for k in lacks) or any(
        v not in KINDS for v in fields.values()
    ):
        raise AdIndexError(f"{file}: fields {fields} lack the built-in attributes or kinds")
    if not isinstance(manifest.get("model_hash"), str | None):
        raise AdIndexError(f"{file}: 'model_hash' must be a string or null")
    expected = {f"{name}.npy" for name in npy_files(manifest["dtype"])} | {"attributes.parquet"}
    if set(manifest["files"]) != expected:
        raise AdIndexError(
            f"{file}: files {sorted(manifest['files'])}, expected {sorted(expected)}"
        )
    for name, info in manifest["files"].items():
        f = path / name
        if not f.is_file():
            raise AdIndexError(f"{f}: missing")
        if not isinstance(info, dict) or f.stat().st_size != info.get("bytes"):
            raise AdIndexError(f"{f}: size {f.stat().st_size} differs from the manifest ({info})")
    return manifest
