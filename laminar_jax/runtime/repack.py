"""Repack executor: runs the pure planner on server snapshots and carries out its moves.

A move is export (source) -> import (destination) of a live sequence with its KV pages; nothing
is prefilled again. Both workers' locks are held for the move, so neither server steps or swaps
weights meanwhile. A move that fails midway is imported back into its source: the sequence ends
on exactly one server.
"""

from __future__ import annotations

import threading
import time
from typing import Sequence

from laminar_jax.scheduler.repack import Move, RepackParams, ServerView, plan_repack


class RepackLoop:
    def __init__(self, workers: Sequence, section, board):
        self.workers = workers  # the runtime's live list: replaced servers show up here
        self.params = RepackParams(c_max=section.c_max, max_batch=section.max_batch)
        self.interval_s = section.repack_interval_s
        self.board = board
        self._poke = threading.Event()
        self._prev_used: dict[str, int] = {}
        self.moved = 0
        self.failed = 0
        self.plans = 0

    def poke(self) -> None:
        """Plan right away (called after each publish)."""
        self._poke.set()

    def views(self) -> list[ServerView]:
        out = []
        for w in list(self.workers):
            with w.lock:
                st = w.server.stats()
                seqs = tuple((uid, pages) for _, uid, pages in w.server.live_sequences())
            sid = st.server_id
            used = st.kv_pages_used
            out.append(ServerView(sid, st.version, st.kv_pages_total, used, self._prev_used.get(sid, used + 1),
                                  seqs, alive=not w.killed.is_set(), draining=not w.admitting(),
                                  max_live=st.slots_total))
            self._prev_used[sid] = used
        return out

    def run_once(self) -> list[Move]:
        moves = plan_repack(self.views(), self.params)
        self.plans += 1
        for m in moves:
            self.execute(m)
        return moves

    def execute(self, move: Move) -> bool:
        by_id = {w.server.section.server_id: w for w in list(self.workers) if not w.killed.is_set()}
        src, dst = by_id.get(move.src), by_id.get(move.dst)
        if src is None or dst is None:
            return False  # one side died since the plan was made
        first, second = sorted((src, dst), key=lambda w: w.index)
        with first.lock, second.lock:
            if src.killed.is_set() or dst.killed.is_set():
                return False
            slot = {uid: s for s, uid, _ in src.server.live_sequences()}.get(move.seq_uid)
            if slot is None or src.server.version != dst.server.version:
                return False  # finished (or the server swapped) since the plan was made
            try:
                state = src.server.export_sequence(slot)
            except KeyError:  # it finished in the step that was still in flight: nothing to move
                return False
            try:
                dst.server.import_sequence(state)
            except Exception:  # noqa: BLE001 - the sequence goes back where it was; counted
                src.server.import_sequence(state)
                self.failed += 1
                return False
            item = src.unassign(move.seq_uid)
            if item is not None:
                dst.assign(item)
            self.moved += 1
            return True

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            self._poke.wait(self.interval_s)
            self._poke.clear()
            if not stop.is_set():
                self.run_once()
            time.sleep(0.01)
