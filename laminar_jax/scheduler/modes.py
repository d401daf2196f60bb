"""Mode policies: when prompts may be dispatched and when a server may take new weights.

The four modes differ only here (plus whether repack runs); the runtime loop and the simulator
are the same code for all of them.

  sync      generate a whole batch, then train on it (verl-style baseline).
  one_step  generation of batch k+1 overlaps training on batch k; weights one step behind.
  stream    continuous dispatch under a staleness bound (AReaL capacity rule); global weight
            updates: all servers drain, then all swap together (AsyncFlow-style).
  laminar   continuous dispatch; each server swaps on its own as soon as it has drained
            (trajectory-level asynchrony), helped by repack.
  inflight  continuous dispatch; each server swaps on its own as soon as a newer version exists,
            between two decode calls, without draining (PipelineRL / AReaL partial rollout): a
            trajectory may span versions, each token stamped with its own (rollout.inflight_kv
            says whether live sequences keep their KV or re-prefill it). No server ever drains,
            so there is nothing for repack to empty: it is off.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, Optional, Sequence


@dataclasses.dataclass(frozen=True)
class ModePolicy:
    """Attributes:
      name: Mode name.
      swap: 'global' (every server swaps at one barrier), 'per_server' (each once drained) or
        'inflight' (each at once, live sequences and all).
      repack: Whether dynamic repack runs in this mode.
      batches_ahead: For sync/one_step: how many batches dispatch may run ahead of the learner.
      bounded_staleness: Dispatch obeys the AReaL capacity rule with max_staleness.
      admit_lag: Per-server swap only: a server keeps admitting new prompts while its version is at
        most this many versions behind the newest (0: it stops as soon as a newer one exists).
    """

    name: str
    swap: Literal["global", "per_server", "inflight"]
    repack: bool
    batches_ahead: Optional[int]
    bounded_staleness: bool
    admit_lag: int = 0


POLICIES = {
    "sync": ModePolicy("sync", "global", False, 0, False),
    "one_step": ModePolicy("one_step", "global", False, 1, False),
    "stream": ModePolicy("stream", "global", False, None, True),
    "laminar": ModePolicy("laminar", "per_server", True, None, False),
    "inflight": ModePolicy("inflight", "inflight", False, None, False),
}


def get_policy(mode: str, repack: bool = True, admit_lag: int = 0) -> ModePolicy:
    """The mode's policy; `admit_lag` applies to per-server swapping (laminar) only."""
    if mode not in POLICIES:
        raise ValueError(f"runtime.mode={mode!r}: must be one of {sorted(POLICIES)}")
    if admit_lag < 0:
        raise ValueError(f"scheduler.admit_lag={admit_lag}: must be >= 0")
    p = POLICIES[mode]
    return dataclasses.replace(p, repack=p.repack and repack,
                               admit_lag=admit_lag if p.swap == "per_server" else 0)


def dispatch_allowance(p: ModePolicy, learner_version: int, dispatched: int, prompts_per_step: int,
                       max_staleness: Optional[int], max_inflight_batches: Optional[int] = None) -> Optional[int]:
    """How many more prompts may be dispatched now; None = no limit (queue capacity still applies).

    learner_version counts completed learner steps; dispatched counts prompts ever dispatched.
      sync/one_step: prompts of batch k may go out once learner_version >= k - batches_ahead,
                     so allowance = (learner_version + 1 + batches_ahead) * B - dispatched.
      stream:        AReaL capacity: (max_staleness + learner_version + 1) * B - dispatched.
      laminar/inflight: no staleness bound unless max_staleness is set (then as stream); only
                     back-pressure: at most max_inflight_batches * B prompts dispatched and not
                     yet trained on, (max_inflight_batches + learner_version) * B - dispatched.
                     Without it, a learner slower than generation lets the buffer (and
                     staleness) grow without end.
    """
    if p.batches_ahead is not None:
        return max(0, (learner_version + 1 + p.batches_ahead) * prompts_per_step - dispatched)
    if p.bounded_staleness or max_staleness is not None:
        eta = 0 if max_staleness is None else max_staleness
        return max(0, (eta + learner_version + 1) * prompts_per_step - dispatched)
    if max_inflight_batches is not None:
        return max(0, (max_inflight_batches + learner_version) * prompts_per_step - dispatched)
    return None


def server_may_admit(p: ModePolicy, server_version: int, newest_version: int, global_pending: bool) -> bool:
    """A server admits new prompts only while it runs the newest version it could take (per-server
    swap: or one at most `admit_lag` versions older).

    A server that knows of a newer version stops admitting so it drains and can swap (or, in
    laminar mode, is emptied sooner by repack). When the learner publishes faster than the long
    tail drains, admit_lag > 0 keeps slots filled between publishes at the price of staleness
    (each trajectory still uses one version). In global modes a pending barrier stops everyone.
    In-flight swapping never drains: a server always admits.
    """
    if p.swap == "inflight":
        return True
    if p.swap == "global":
        return not global_pending
    return server_version >= newest_version - p.admit_lag


def swap_now(p: ModePolicy, server_live: int, live_per_server: Sequence[int]) -> bool:
    """May this server load the newest version now? Never with a live sequence (one version per
    trajectory); in global modes only once every server has drained. In-flight swapping: always."""
    if p.swap == "inflight":
        return True
    if server_live > 0:
        return False
    return p.swap == "per_server" or all(n == 0 for n in live_per_server)


def default_max_queued_prompts(prompts_per_step: int, num_servers: int) -> int:
    """The work queue's bound in prompts: one learner step's worth, or two per server if more
    (enough that no server waits for work between dispatcher pumps)."""
    return max(prompts_per_step, 2 * num_servers)


def queue_room(max_queued_prompts: int, queued_samples: int, samples_per_prompt: int) -> int:
    """Prompts the dispatcher may add to a work queue holding ``queued_samples`` samples (not yet
    taken by a server) without exceeding ``max_queued_prompts``; may be <= 0 (nothing)."""
    return max_queued_prompts - queued_samples // samples_per_prompt
