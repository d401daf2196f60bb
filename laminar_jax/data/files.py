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
    rows = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path} row {len(rows)} (line {line_no})"
            try:
                rows.append((where, json.loads(line)))
            except json.JSONDecodeError as e:
                rows.append((where, BadRowError(where, f"invalid JSON: {e}")))
    return rows


def _read_json(path: str) -> list[tuple[str, Any]]:
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        return _read_jsonl(path)  # a .json file holding JSON lines
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
