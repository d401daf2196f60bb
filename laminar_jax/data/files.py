"""Reading verl-layout prompt files (parquet, jsonl, json) into an in-memory random-access row list."""

from __future__ import annotations

import glob
import json
import os
from typing import Any

from laminar_jax.data.records import BadRowError


def list_files(path: str) -> list[str]:
    """A file, or a glob; sorted so the row numbering (and hence uids) is stable."""
    files = sorted(glob.glob(path)) if glob.has_magic(path) else [path]
    files = [f for f in files if os.path.isfile(f)]
    if not files:
        raise FileNotFoundError(f"data.path={path!r}: no prompt files found")
    for f in files:
        if not f.endswith((".parquet", ".jsonl", ".json")):
            raise ValueError(f"{f}: unsupported prompt file type (expected .parquet, .jsonl or .json)")
    return files


def _read_jsonl(path: str) -> list[tuple[str, Any]]:
    """Lines are decoded one by one: a line that is not UTF-8 is a bad row (named by file, row and
    line), never a failure of the whole file."""
    rows = []
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            where = f"{path} row {len(rows)} (line {line_no})"
            try:
                rows.append((where, json.loads(raw.decode("utf-8"))))
            except UnicodeDecodeError as e:
                rows.append((where, BadRowError(where, f"not valid UTF-8: byte 0x{raw[e.start]:02x} at "
                                                       f"column {e.start + 1}")))
            except json.JSONDecodeError as e:
                rows.append((where, BadRowError(where, f"invalid JSON: {e}")))
    return rows


def _read_json(path: str) -> list[tuple[str, Any]]:
    with open(path, "rb") as f:
        raw = f.read()
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return _read_jsonl(path)  # a .json file holding JSON lines (or a bad line to name)
    if not isinstance(data, list):
        raise ValueError(f"{path}: a .json prompt file must hold a list of rows, got {type(data).__name__}")
    return [(f"{path} row {i}", r) for i, r in enumerate(data)]


def _read_parquet(path: str) -> list[tuple[str, Any]]:
    import pyarrow.parquet as pq

    return [(f"{path} row {i}", r) for i, r in enumerate(pq.read_table(path).to_pylist())]


def read_rows(path: str) -> list[tuple[str, Any]]:
    """All rows of all files matching ``path`` as (where, raw_row); unparsable lines become BadRowError."""
    out: list[tuple[str, Any]] = []
    for f in list_files(path):
        if f.endswith(".parquet"):
            out.extend(_read_parquet(f))
        elif f.endswith(".jsonl"):
            out.extend(_read_jsonl(f))
        else:
            out.extend(_read_json(f))
    if not out:
        raise ValueError(f"data.path={path!r}: the prompt files hold no rows")
    return out
