"""Config section for the experience buffer."""

from __future__ import annotations

import dataclasses
from typing import Literal, Optional

from laminar_jax.configlib import expect


@dataclasses.dataclass(frozen=True)
class BufferSection:
    """Experience buffer and its sampling policy.

    Attributes:
      max_staleness: The one staleness bound (learner version - generating version): dispatch obeys AReaL's capacity rule with it, and groups over it are dropped or skipped (on_stale); required by runtime.mode='stream'; None = unbounded (laminar's default: back-pressure only, runtime.max_inflight_batches).
      on_stale: 'drop' discards over-stale groups (counted); 'skip' leaves them unconsumed.
    """

    max_staleness: Optional[int] = None
    on_stale: Literal["drop", "skip"] = "drop"

    def validate(self, prefix: str) -> None:
        if self.max_staleness is not None:
            expect(self.max_staleness >= 0, f"{prefix}.max_staleness", self.max_staleness, ">= 0 or None")
