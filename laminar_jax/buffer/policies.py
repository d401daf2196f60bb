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
      rewards: The members' rewards, where the store has them (dynamic sampling reads them).
    """

    group: str
    rows: tuple[int, ...]
    version: int
    num_tokens: int
    seq: int
    rewards: tuple[float, ...] = ()


@dataclasses.dataclass(frozen=True)
class Selection:
    """take: the batch (all or nothing); drop: over-stale groups; filtered: zero-signal groups
    (dynamic sampling). Dropped and filtered groups are never trained on."""

    take: tuple[GroupMeta, ...]
    drop: tuple[GroupMeta, ...]
    filtered: tuple[GroupMeta, ...] = ()


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
    fresh, drop = _split_stale(groups, learner_version, max_staleness, on_stale)
    if len(fresh) < n_groups:
        return Selection((), drop)
    return Selection(tuple(fresh[:n_groups]), drop)


def _split_stale(groups: Sequence[GroupMeta], learner_version: int, max_staleness: Optional[int],
                 on_stale: str) -> tuple[list[GroupMeta], tuple[GroupMeta, ...]]:
    """(fresh groups oldest first, the stale ones to drop: none with on_stale='skip')."""
    fresh, stale = [], []
    for g in sorted(groups, key=lambda g: g.seq):
        if max_staleness is not None and staleness(learner_version, g.version) > max_staleness:
            stale.append(g)
        else:
            fresh.append(g)
    return fresh, tuple(stale) if on_stale == "drop" else ()


def zero_signal(g: GroupMeta) -> bool:
    """Every member of a group of two or more scored the same reward: GRPO/RLOO give it advantage 0."""
    return len(g.rows) > 1 and len(g.rewards) == len(g.rows) and max(g.rewards) == min(g.rewards)


def select_with_signal(groups: Sequence[GroupMeta], n_groups: int, learner_version: int, budget: int,
                       max_staleness: Optional[int] = None, on_stale: str = "drop") -> Selection:
    """`select_fifo` with DAPO's dynamic sampling: walking the fresh groups oldest first until
    ``n_groups`` are taken, a zero-signal group is filtered instead, while fewer than ``budget`` have
    been (the bound on refills; past it zero-signal groups are taken like any other). Filtered groups
    leave at once, batch full or not, so that fresh prompts can replace them; the groups after the
    n-th taken one stay for the next batch."""
    fresh, drop = _split_stale(groups, learner_version, max_staleness, on_stale)
    take: list[GroupMeta] = []
    filtered: list[GroupMeta] = []
    for g in fresh:
        if len(take) == n_groups:
            break
        if zero_signal(g) and len(filtered) < budget:
            filtered.append(g)
        else:
            take.append(g)
    return Selection(tuple(take) if len(take) == n_groups else (), drop, tuple(filtered))
