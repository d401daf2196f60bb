"""Config section for the experience buffer."""

from __future__ import annotations

import dataclasses
from typing import Literal, Optional

from laminar_jax.configlib import expect


@dataclasses.dataclass(frozen=True)
class BufferSection:
    """Experience buffer and its sampling policy.

    Attributes:
      sampler: 'fifo' (oldest complete group first).
      max_staleness: Drop/skip groups whose staleness (learner version - generating version) exceeds this; None = unbounded (Laminar's default).
      on_stale: 'drop' discards over-stale groups (counted); 'skip' leaves them unconsumed.
      balance_tokens: Split each batch into token-balanced micro-batches (Karmarkar-Karp style).
      get_timeout_s: How long the learner waits for a batch before the run fails with a named error.
    """

    sampler: Literal["fifo"] = "fifo"
    max_staleness: Optional[int] = None
    on_stale: Literal["drop", "skip"] = "drop"
    balance_tokens: bool = True
    get_timeout_s: float = 600.0

    def validate(self, prefix: str) -> None:
        if self.max_staleness is not None:
            expect(self.max_staleness >= 0, f"{prefix}.max_staleness", self.max_staleness, ">= 0 or None")
        expect(self.get_timeout_s > 0, f"{prefix}.get_timeout_s", self.get_timeout_s, "> 0")
