"""Pure sampling policies over ready experience: which rows a consumer gets, which are dropped.

Everything here is a function of plain data, shared by the real buffer and the simulator.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence


@dataclasses.dataclass(frozen=True)
class GroupMeta:
    """A complete group of rows (a GRPO group, or a single row when group size is 1).

    Attributes:
      group: Group key (the prompt uid).
      rows: Row ids of the group's members.
      version: Oldest weight version among the members (staleness is judged on it).
      num_tokens: Total tokens (prompt + response) over the members.
      seq: Arrival order of the group's completion (FIFO key).
    """

    group: str
    rows: tuple[int, ...]
    version: int
    num_tokens: int
    seq: int


@dataclasses.dataclass(frozen=True)
class Selection:
    take: tuple[GroupMeta, ...]
    drop: tuple[GroupMeta, ...]


def staleness(learner_version: int, gen_version: int) -> int:
    """Staleness = learner version at consumption - generating version (>= 0 in practice)."""
    return learner_version - gen_version


def select_fifo(groups: Sequence[GroupMeta], n_groups: int, learner_version: int,
                max_staleness: Optional[int] = None, on_stale: str = "drop") -> Selection:
    """Oldest-complete-first selection of ``n_groups`` groups.

    With ``max_staleness`` set, groups with staleness > max_staleness are dropped
    (``on_stale='drop'``) or left in place and skipped (``on_stale='skip'``, for a runtime whose
    admission control keeps staleness bounded so they are rare). Returns an empty ``take`` unless
    ``n_groups`` fresh groups are available: a batch is all-or-nothing.
    """
    ordered = sorted(groups, key=lambda g: g.seq)
    fresh, stale = [], []
    for g in ordered:
        if max_staleness is not None and staleness(learner_version, g.version) > max_staleness:
            stale.append(g)
        else:
            fresh.append(g)
    drop = tuple(stale) if on_stale == "drop" else ()
    if len(fresh) < n_groups:
        return Selection((), drop)
    return Selection(tuple(fresh[:n_groups]), drop)
