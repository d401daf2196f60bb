"""AReaL-style partial rollout: a simulator-only mode policy (not in laminar_jax.scheduler.modes).

At every global update each server interrupts its live sequences, loads the new weights, re-prefills
the kept tokens (prompt + generated so far) under the new weights and continues decoding; a
trajectory may therefore mix versions and its staleness is judged on its oldest segment. Dispatch
obeys AReaL's capacity rule, computed by the project's own ``dispatch_allowance`` on a
bounded-staleness policy so the formula lives in one place.
"""

from __future__ import annotations

from typing import Optional

from laminar_jax.scheduler import modes

NAME = "partial_rollout"


def policy() -> modes.ModePolicy:
    """Per-server interrupt swaps, no repack, bounded staleness (AReaL capacity rule)."""
    return modes.ModePolicy(NAME, "per_server", False, None, True)


def dispatch_allowance(learner_version: int, dispatched: int, prompts_per_step: int,
                       max_staleness: Optional[int]) -> Optional[int]:
    """(max_staleness + learner_version + 1)·B − dispatched, via modes.dispatch_allowance."""
    return modes.dispatch_allowance(policy(), learner_version, dispatched, prompts_per_step, max_staleness)


def server_may_admit(loading: bool) -> bool:
    """A server admits whenever it is not loading weights (interrupts replace draining)."""
    return not loading


def interrupt_now(server_version: int, newest_version: int, loading: bool) -> bool:
    """Interrupt and swap as soon as a newer version exists, live sequences or not."""
    return newest_version > server_version and not loading
