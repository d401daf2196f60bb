"""Sample-level experience store (AsyncFlow TransferQueue idea), thread-safe.

Rows are samples, each held as its record (`Trajectory`); fields (prompt_ids, response_ids,
behaviour_logprobs, version, reward, ...) become ready one by one as producers write them onto it.
A consumer asks for N groups whose required fields are all ready in every member and that it has
not consumed yet; the records themselves are handed out (no copy) and marked consumed. A group
(the GRPO samples of one prompt) is released only when complete. Rows of plain fields are made
only for a checkpoint (`state_dict`).
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Optional, Sequence

import numpy as np

from laminar_jax.buffer.policies import GroupMeta, Selection, select_fifo
from laminar_jax.types import Trajectory, from_row, set_field


class BufferTimeout(TimeoutError):
    pass


class ExperienceStore:
    """Rows x fields table (one `Trajectory` record per row) with per-consumer consumption marks.

    ``group_size`` is the number of rows that make a group complete (n samples per prompt).
    """

    def __init__(self, group_size: int = 1, capacity_groups: int = 1 << 30):
        self.group_size = group_size
        self.capacity_groups = capacity_groups
        self._cv = threading.Condition()
        self._rows: dict[int, Trajectory] = {}
        self._row_group: dict[int, str] = {}
        self._groups: dict[str, list[int]] = {}
        self._uid_row: dict[str, int] = {}
        self._consumed: dict[str, set[int]] = {}
        self._field_seq: dict[int, dict[str, int]] = {}  # row -> field -> write order (the ready fields)
        self._next_row = 0
        self._seq = 0
        self.counters = {"rows_put": 0, "groups_dropped_stale": 0, "groups_filtered": 0, "rows_consumed": 0}

    # ---- producers -------------------------------------------------------------------------
    def add_row(self, uid: str, group: str, fields: Optional[dict[str, Any]] = None) -> int:
        """Create a row (idempotent per uid) and write any fields given."""
        with self._cv:
            row = self._uid_row.get(uid)
            if row is None:
                row = self._new_row(from_row({"uid": uid}, group), group)
            for k, v in (fields or {}).items():
                self._write(row, k, v)
            self._cv.notify_all()
            return row

    def add(self, record: Trajectory, fields: Sequence[str]) -> Trajectory:
        """Hold a sample's record (its group is its prompt_uid), with `fields` ready, and return it;
        a record of the same uid held already has those fields rewritten from this one (a
        re-dispatch) and is returned instead."""
        with self._cv:
            row = self._uid_row.get(record.uid)
            if row is None:
                row = self._new_row(record, record.prompt_uid)
                for k in fields:
                    self._field_seq[row][k] = self._bump()
            else:
                for k in fields:
                    self._write(row, k, getattr(record, k))
            self._cv.notify_all()
            return self._rows[row]

    def _new_row(self, record: Trajectory, group: str) -> int:
        row = self._next_row
        self._next_row += 1
        self._uid_row[record.uid] = row
        self._rows[row] = record
        self._field_seq[row] = {}
        self._row_group[row] = group
        self._groups.setdefault(group, []).append(row)
        self.counters["rows_put"] += 1
        return row

    def put(self, uid: str, field: str, value: Any) -> None:
        """Mark one field of an existing row ready."""
        with self._cv:
            if uid not in self._uid_row:
                raise KeyError(f"experience store: no row with uid {uid!r}")
            self._write(self._uid_row[uid], field, value)
            self._cv.notify_all()

    def put_many(self, uid: str, fields: dict[str, Any]) -> None:
        """Mark several fields of an existing row ready at once (one notification)."""
        with self._cv:
            if uid not in self._uid_row:
                raise KeyError(f"experience store: no row with uid {uid!r}")
            row = self._uid_row[uid]
            for k, v in fields.items():
                self._write(row, k, v)
            self._cv.notify_all()

    def row(self, uid: str) -> Trajectory:
        """One row's record (the store's own: read it, write through `put`)."""
        with self._cv:
            if uid not in self._uid_row:
                raise KeyError(f"experience store: no row with uid {uid!r}")
            return self._rows[self._uid_row[uid]]

    def groups(self) -> set[str]:
        with self._cv:
            return set(self._groups)

    def _write(self, row: int, field: str, value: Any) -> None:
        if field == "uid":
            return  # a row's key, fixed when it is made
        set_field(self._rows[row], field, value)
        self._field_seq[row][field] = self._bump()

    def _ready(self, row: int, field: str) -> bool:
        return field == "uid" or field in self._field_seq[row]

    # ---- consumers -------------------------------------------------------------------------
    def _complete_groups(self, consumer: str, fields: Sequence[str]) -> list[GroupMeta]:
        consumed = self._consumed.get(consumer, set())
        out = []
        for group, rows in self._groups.items():
            if len(rows) < self.group_size or any(r in consumed for r in rows):
                continue
            if not all(self._ready(r, f) for r in rows for f in fields):
                continue
            # Completion order = when the last required field of the last member was written.
            seq = max(self._field_seq[r].get(f, 0) for r in rows for f in fields)
            versions = [int(self._rows[r].get("version", 0)) for r in rows]
            tokens = sum(len(self._rows[r].get("prompt_ids", ())) + len(self._rows[r].get("response_ids", ()))
                         for r in rows)
            rewards = tuple(float(self._rows[r].reward) for r in rows if self._rows[r].reward is not None)
            out.append(GroupMeta(group, tuple(rows), min(versions), tokens, seq, rewards))
        return out

    def _bump(self) -> int:
        self._seq += 1
        return self._seq

    def complete_group_keys(self, fields: Sequence[str]) -> set[str]:
        """Groups whose every member has all `fields` (consumed or not)."""
        with self._cv:
            return {g for g, rows in self._groups.items()
                    if len(rows) >= self.group_size and all(self._ready(r, f) for r in rows for f in fields)}

    def samples_missing(self, group: str, fields: Sequence[str], group_size: int) -> list[int]:
        """Sample indices (uid suffix '/i') of `group` that lack any of `fields` or have no row."""
        with self._cv:
            have = {}
            for r in self._groups.get(group, []):
                idx = int(self._rows[r].uid.rsplit("/", 1)[1])
                have[idx] = all(self._ready(r, f) for f in fields)
            return [i for i in range(group_size) if not have.get(i, False)]

    def discard_group(self, group: str) -> None:
        """Forget a group's rows (e.g. dropped prompt)."""
        with self._cv:
            for row in self._groups.pop(group, []):
                uid = self._rows.pop(row).uid
                del self._uid_row[uid]
                self._row_group.pop(row, None)
                self._field_seq.pop(row, None)

    def ready_groups(self, consumer: str, fields: Sequence[str]) -> int:
        with self._cv:
            return len(self._complete_groups(consumer, fields))

    def get(self, consumer: str, n_groups: int, fields: Sequence[str], timeout: float,
            select: Optional[Callable[[list[GroupMeta], int], Selection]] = None,
            ) -> list[Trajectory]:
        """Block until ``n_groups`` complete, unconsumed groups are selectable; return their records.

        ``select(groups, n)`` is the sampling policy (FIFO by default). Dropped and filtered groups
        are marked consumed for this consumer and counted. Raises BufferTimeout naming what it waited for.
        """
        select = select or (lambda gs, n: select_fifo(gs, n, learner_version=0))
        deadline = time.monotonic() + timeout
        with self._cv:
            while True:
                sel = select(self._complete_groups(consumer, fields), n_groups)
                consumed = self._consumed.setdefault(consumer, set())
                for g in sel.drop:
                    consumed.update(g.rows)
                    self.counters["groups_dropped_stale"] += 1
                for g in sel.filtered:
                    consumed.update(g.rows)
                    self.counters["groups_filtered"] += 1
                if sel.take:
                    rows = [r for g in sel.take for r in g.rows]
                    consumed.update(rows)
                    self.counters["rows_consumed"] += len(rows)
                    return [self._rows[r] for r in rows]
                left = deadline - time.monotonic()
                if left <= 0:
                    ready = len(self._complete_groups(consumer, fields))
                    raise BufferTimeout(
                        f"experience store: consumer {consumer!r} waited {timeout:.1f}s for {n_groups} "
                        f"complete groups with fields {list(fields)}; {ready} ready")
                self._cv.wait(min(left, 0.5))

    def evict_consumed(self, consumers: Sequence[str]) -> int:
        """Delete rows every listed consumer has consumed; returns the number deleted."""
        with self._cv:
            sets = [self._consumed.get(c, set()) for c in consumers]
            done = set.intersection(*sets) if sets else set()
            for row in done:
                uid = self._rows.pop(row).uid
                del self._uid_row[uid]
                group = self._row_group.pop(row)
                rows = self._groups.get(group, [])
                if row in rows:
                    rows.remove(row)
                if not rows:
                    self._groups.pop(group, None)
                self._field_seq.pop(row, None)
            for s in sets:
                s.difference_update(done)
            return len(done)

    def __len__(self) -> int:
        with self._cv:
            return len(self._rows)

    # ---- checkpoint ------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """JSON-serialisable snapshot: each record as a row of its ready fields (numpy arrays become
        lists with their dtype)."""
        with self._cv:
            rows = []
            for row in sorted(self._rows):
                rec = self._rows[row]
                fields = {"uid": rec.uid, **{k: _enc(getattr(rec, k)) for k in self._field_seq[row]}}
                # field_seq copied: a checkpoint is written after its snapshot, and a field scored in
                # between must not restore as ready without its value.
                rows.append({"row": row, "group": self._row_group[row], "fields": fields,
                             "field_seq": dict(self._field_seq[row])})
            return {"group_size": self.group_size, "rows": rows,
                    "consumed": {c: sorted(s) for c, s in self._consumed.items()},
                    "next_row": self._next_row, "seq": self._seq, "counters": dict(self.counters)}

    def load_state_dict(self, state: dict) -> None:
        with self._cv:
            self.__init__(group_size=state["group_size"], capacity_groups=self.capacity_groups)
            for r in state["rows"]:
                row = int(r["row"])
                fields = {k: _dec(v) for k, v in r["fields"].items()}
                self._rows[row] = from_row(fields, r["group"])
                self._field_seq[row] = {k: int(v) for k, v in r["field_seq"].items()}
                self._uid_row[fields["uid"]] = row
                self._row_group[row] = r["group"]
                self._groups.setdefault(r["group"], []).append(row)
            self._consumed = {c: set(v) for c, v in state["consumed"].items()}
            self._next_row = int(state["next_row"])
            self._seq = int(state["seq"])
            self.counters.update(state["counters"])


def _enc(v: Any) -> Any:
    if isinstance(v, np.ndarray):
        return {"__nd__": v.tolist(), "dtype": str(v.dtype)}
    if isinstance(v, np.generic):
        return v.item()
    return v


def _dec(v: Any) -> Any:
    if isinstance(v, dict) and "__nd__" in v:
        return np.asarray(v["__nd__"], dtype=v["dtype"])
    return v
