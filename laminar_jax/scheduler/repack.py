"""Dynamic repack policy (Laminar): consolidate long-tail sequences onto few servers.

Pure: takes plain snapshots of server state, returns decisions; executes nothing. The runtime's
scheduler and the simulator call this same function.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence


@dataclasses.dataclass(frozen=True)
class ServerView:
    """What the policy needs to know of one rollout server.

    Attributes:
      server_id: Unique id.
      version: Weight version the server runs (moves never cross versions).
      kv_pages_total: KV capacity in pages.
      kv_pages_used: Pages in use now.
      kv_pages_used_prev: Pages in use at the previous poll (to tell 'falling').
      seq_pages: Pages held by each live sequence, keyed by sequence uid.
      alive: False for a server that stopped answering (never a source or destination).
      draining: The server knows of a newer version, so it admits nothing and its batch can only
        shrink: a source even when its KV use has not fallen since the last poll (a poll right
        after a publish would otherwise see the admissions before it as 'rising').
      max_live: Sequences the server can hold at once (its slots) when it is a destination; None = only max_batch bounds it.
    """

    server_id: str
    version: int
    kv_pages_total: int
    kv_pages_used: int
    kv_pages_used_prev: int
    seq_pages: tuple[tuple[str, int], ...]
    alive: bool = True
    draining: bool = False
    max_live: Optional[int] = None

    @property
    def live(self) -> int:
        return len(self.seq_pages)

    @property
    def kv_frac(self) -> float:
        return self.kv_pages_used / max(1, self.kv_pages_total)


@dataclasses.dataclass(frozen=True)
class RepackParams:
    """Attributes:
      c_max: A destination may fill its KV up to this fraction (e.g. 0.99).
      max_batch: B, the roofline batch bound: a source has fewer live sequences than B, and a destination may not exceed B.
      require_falling: Only servers whose KV use is falling are sources (their batch is draining).
    """

    c_max: float = 0.99
    max_batch: int = 64
    require_falling: bool = True


@dataclasses.dataclass(frozen=True)
class Move:
    seq_uid: str
    src: str
    dst: str


def is_source(s: ServerView, p: RepackParams) -> bool:
    falling = s.kv_pages_used < s.kv_pages_used_prev or s.draining or not p.require_falling
    return s.alive and s.live > 0 and s.kv_frac < p.c_max and falling and s.live < p.max_batch


def plan_repack(servers: Sequence[ServerView], params: RepackParams) -> list[Move]:
    """Best-Fit bin packing of draining servers' sequences, per weight version. O(|S|^2).

    Sources (see :func:`is_source`) are taken in ascending KV use; each source's live sequences
    all go to the one feasible destination of the same version that ends up fullest, where
    feasible means pages_after <= c_max * capacity and live_after <= min(max_batch, max_live). A server that
    received sequences is not emptied later in the same plan, and an emptied one receives none.
    """
    moves: list[Move] = []
    by_version: dict[int, list[ServerView]] = {}
    for s in servers:
        if s.alive:
            by_version.setdefault(s.version, []).append(s)
    for group in by_version.values():
        used = {s.server_id: s.kv_pages_used for s in group}
        live = {s.server_id: s.live for s in group}
        emptied: set[str] = set()
        received: set[str] = set()
        for src in sorted((s for s in group if is_source(s, params)), key=lambda s: (s.kv_frac, s.server_id)):
            if src.server_id in received:
                continue
            need_pages = sum(n for _, n in src.seq_pages)
            best, best_fill = None, -1.0
            for dst in group:
                if dst.server_id == src.server_id or dst.server_id in emptied:
                    continue
                pages_after = used[dst.server_id] + need_pages
                live_after = live[dst.server_id] + src.live
                cap = params.max_batch if dst.max_live is None else min(params.max_batch, dst.max_live)
                if pages_after > params.c_max * dst.kv_pages_total or live_after > cap:
                    continue
                fill = pages_after / dst.kv_pages_total
                if fill > best_fill:
                    best, best_fill = dst, fill
            if best is None:
                continue
            moves.extend(Move(uid, src.server_id, best.server_id) for uid, _ in src.seq_pages)
            used[best.server_id] += need_pages
            live[best.server_id] += src.live
            used[src.server_id], live[src.server_id] = 0, 0
            emptied.add(src.server_id)
            received.add(best.server_id)
    return moves
