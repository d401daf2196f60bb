"""A RolloutServer's figures: the token rate over a sliding window and the ServerStats record."""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING

from laminar_jax.rollout.records import ServerStats

if TYPE_CHECKING:
    from laminar_jax.rollout.server import RolloutServer

RATE_WINDOW_S = 5.0


class TokenRate:
    """Tokens per second over the last ``window_s``, O(1) to read (stats() runs every poll)."""

    def __init__(self, window_s: float = RATE_WINDOW_S):
        self.window_s = window_s
        self._rate: collections.deque = collections.deque()  # (time, tokens) per step
        self._sum = 0  # sum of the tokens in _rate

    def add(self, now: float, n_tokens: int) -> None:
        self._rate.append((now, n_tokens))
        self._sum += n_tokens
        while self._rate and self._rate[0][0] < now - self.window_s:
            self._sum -= self._rate.popleft()[1]

    def per_s(self) -> float:
        span = (self._rate[-1][0] - self._rate[0][0]) if len(self._rate) > 1 else 0.0
        # Tokens after the first entry over the span they were produced in.
        return (self._sum - self._rate[0][1]) / span if span > 0 else 0.0


def server_stats(srv: "RolloutServer") -> ServerStats:
    """``srv``'s figures now (the caller holds its lock)."""
    slots, counts = srv._books.slots, srv._books.counts
    per_version = collections.Counter(x.version for x in [*slots, *srv._episodes.released.values()]
                                      if x is not None)
    alloc = srv.engine.page_book.allocator
    return ServerStats(
        server_id=srv.section.server_id, version=srv._version, slots_used=sum(x is not None for x in slots),
        slots_total=len(slots), kv_pages_used=alloc.num_used, kv_pages_total=alloc.num_pages - 1,
        live_per_version=dict(per_version), tokens_per_s=srv._rate.per_s(),
        queue_length=srv._queue.qsize() + (srv._admitter.head is not None),
        pending_version=None if srv._pending is None else srv._pending[0],
        completed=counts["completed"], rejected_overlong=counts["rejected_overlong"],
        truncated_overlong=counts["truncated_overlong"], aborted=counts["aborted"],
        prompts_prefilled=counts["prompts_prefilled"], prompts_shared=counts["prompts_shared"],
        decode_kernel=srv.engine.kernels.summary())
