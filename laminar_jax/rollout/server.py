"""RolloutServer: continuous batching over the engine's slots, weight swaps, live-sequence moves.

Step-driven: ``step()`` = (maybe swap weights) + admission + one generate() dispatch, and returns
the Trajectories that finished. Generation is pipelined: step n dispatches generate call n and
then reads the tokens of call n-1, so the host bookkeeping overlaps the device's work. This is
safe because the device itself retires finished slots (stop id / max_new, see Engine._step): a
slot is only reused after the host has read its ``done`` flag, and an inactive slot writes only
to the null page.

Weight versions: ``set_params(v, params)`` records a pending version; admission stops; when no
live sequence of the old version remains the swap happens and admission resumes. Params given as
``HostWeights`` (host arrays) are streamed into place at the swap, tensor by tensor, each old
buffer deleted before its replacement is placed: the devices never hold two versions. ``force=True``
swaps at the next step, aborting live old-version sequences (finish_reason='aborted', tokens so
far, stamped with the old version) so no trajectory ever mixes versions. ``inflight=True``
(runtime.mode='inflight', rollout/inflight.py) swaps at the next step without draining: live
sequences go on under the new version, each token stamped with the version that sampled it.

Its parts live beside it: admission.py (requests checked on submit, then started in free slots;
no preemption), books.py (the slots' host books and finished trajectories), episodes.py
(multi-turn episodes: turn ends, waiting, continue/end), moves.py (export/import of live
sequences between servers), server_stats.py (figures).
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any, Callable, NamedTuple, Optional

import jax
import numpy as np

from laminar_jax.rollout import moves
from laminar_jax.rollout.admission import Admitter, prepare
from laminar_jax.rollout.books import SlotBooks
from laminar_jax.rollout.engine import Engine
from laminar_jax.rollout.episodes import Episodes
from laminar_jax.rollout.records import QueueFullError, Request, SequenceState, ServerStats
from laminar_jax.rollout.sampling import default_sampling
from laminar_jax.rollout.server_stats import TokenRate, server_stats
from laminar_jax.rollout.warmup import warmup as warmup_engine
from laminar_jax.types import Trajectory


class HostWeights(NamedTuple):
    """A version's weights as a host tree shaped like the engine's params, to be streamed onto a
    server's devices at its swap (ParamPlacement.swap: each old tensor deleted before its
    replacement is placed). on_leaf(i, placed) observes each placement (tests). lora: a LoraDelta
    (rollout/lora_merge.py): ``tree`` is the pristine base and these adapters are merged into it
    at the swap."""

    tree: Any
    on_leaf: Optional[Callable[[int, Any], None]] = None
    lora: Any = None


class RolloutServer:
    """Continuous-batching server over one Engine. Its owner calls step() (the runtime's
    RolloutWorker, in a supervised thread; the offline front door, in the caller's). Every public
    method takes the server's lock; its parts (admission, books, episodes, moves) run under it."""

    def __init__(self, engine: Engine, params: Any, version: int = 0):
        """params: the engine's params on its devices, or HostWeights (placed now; such a server
        owns its weights and streams every later HostWeights version into place)."""
        self.engine = engine
        self.section = engine.section
        if isinstance(params, HostWeights) and params.lora is not None:
            from laminar_jax.rollout.lora_merge import merged_tree

            params = merged_tree(engine.placement.place(params.tree), params.lora)
        self._params = engine.placement.place(params.tree) if isinstance(params, HostWeights) else params
        self._version = int(version)
        self._state = engine.init_decode_state()
        self._books = SlotBooks(engine, self.section.server_id)
        self._holders = self._books.holders  # the same dict: prompt bytes -> slots holding its KV
        self._queue: queue.Queue = queue.Queue(maxsize=self.section.queue_capacity)
        self._pending: Optional[tuple[int, Any, bool, bool]] = None  # (version, params, force, inflight)
        self._inflight = None  # StepOutput of the last dispatched generate(), not yet read
        self._lock = threading.RLock()
        self._rate = TokenRate()
        self._default = default_sampling(self.section, tuple(engine.model_cfg.eos_token_id))
        self._n_consumed = 0  # generate() outputs read so far
        self._admitter = Admitter(self)
        self._episodes = Episodes(self)
        self._last_stats = server_stats(self)  # what stats(wait=False) answers while a step holds the lock

    @property
    def device_ids(self) -> tuple:
        """Ids of the devices this server's engine runs on: servers on the same ones share compiled programs."""
        return tuple(d.id for d in self.engine.devices)

    def warmup(self) -> None:
        """Compile the engine's programs for this server's weights (on a throwaway decode state)."""
        with self._lock:
            warmup_engine(self.engine, self._params)

    @classmethod
    def from_model(cls, model, section, version: int = 0, **engine_kwargs) -> "RolloutServer":
        from laminar_jax.rollout.engine import make_engine

        engine, params = make_engine(model, section, **engine_kwargs)
        return cls(engine, params, version)

    # ---------------------------------------------------------------- requests

    def submit(self, request: Request, timeout: Optional[float] = None) -> None:
        """Validate and enqueue. Blocks up to ``timeout`` s for queue space (None = forever)."""
        adm = prepare(request, self.section, self._default, self._books.counts)
        try:
            self._queue.put(adm, timeout=timeout)
        except queue.Full:
            raise QueueFullError(f"server {self.section.server_id}: request queue full "
                                 f"(rollout.queue_capacity={self.section.queue_capacity}) after waiting "
                                 f"{timeout}s to submit {request.uid!r}") from None

    # ---------------------------------------------------------------- the loop

    def step(self) -> list[Trajectory]:
        """One admission pass + one generate() dispatch; returns the trajectories that finished."""
        with self._lock:
            self._maybe_swap()
            self._episodes.release_parked()
            self._episodes.resume_released()  # before new requests: they hold pages already
            self._admitter.admit()
            prev, self._inflight = self._inflight, None
            if any(x is not None and not x.waiting for x in self._books.slots):
                self._state, self._inflight = self.engine.generate(self._params, self._state)
            if prev is not None:
                self._consume(prev)
            return self._books.take_finished()

    @property
    def num_live(self) -> int:
        """Live sequences: in slots, and episodes waiting without one (a weight swap waits for all)."""
        return sum(x is not None for x in self._books.slots) + len(self._episodes.released)

    def has_work(self) -> bool:
        """Whether a step() now has anything to do: a step in flight to read, a queued request, a
        released episode to resume, or a sequence in a slot that is not waiting on its environment.
        False while every live sequence waits on its environment, so the owner's loop can sleep
        instead of spinning (four spinning servers took a core from the learner and the envs)."""
        with self._lock:
            return (self._inflight is not None or self._admitter.head is not None or not self._queue.empty()
                    or bool(self._episodes.resume) or any(x is not None and not x.waiting for x in self._books.slots))

    def idle(self) -> bool:
        """Nothing live, nothing queued, nothing in flight."""
        return self.num_live == 0 and not (self._inflight is not None or self._admitter.head is not None
                                           or not self._queue.empty())

    def _consume(self, out) -> None:
        """Read one generate() output (blocks on the device) and retire finished sequences."""
        out = jax.device_get(out)
        self._n_consumed += 1
        if np.any(out.overflow):
            raise RuntimeError(f"server {self.section.server_id}: live KV pages exceeded the engine's "
                               "live-page bucket (engine length bookkeeping is wrong; outputs of this call are invalid)")
        n_tokens = 0
        slots = self._books.slots
        # Python scalars via tolist(): per-element numpy indexing costs ~1 us each, a few % of a step.
        tokens, logprobs, done, stopped = (x.tolist() for x in (out.tokens, out.logprobs, out.done, out.stopped))
        for i in range(out.tokens.shape[0]):
            for slot in np.flatnonzero(out.emitted[i]).tolist():
                live = slots[slot]
                if live is None or live.waiting:
                    continue  # decoded past a host-side stop sequence (pipelining): not part of the turn
                live.tokens.append(tokens[i][slot])
                live.logprobs.append(logprobs[i][slot])
                live.versions.append(self._version)  # every output read was dispatched with these weights
                n_tokens += 1
                if live.mask is not None:
                    self._episodes.on_token(slot, live, done[i][slot], stopped[i][slot])
                elif done[i][slot]:
                    self._books.retire(slot, "eos" if stopped[i][slot] else "length")
        self._rate.add(time.monotonic(), n_tokens)

    def _drain(self) -> None:
        """Read the in-flight output so host bookkeeping matches the device exactly."""
        if self._inflight is not None:
            prev, self._inflight = self._inflight, None
            self._consume(prev)

    # ---------------------------------------------------------------- multi-turn episodes (episodes.py)

    def take_turns(self) -> list:
        """The TurnEnds since the last call (each sequence named waits for continue/end_episode)."""
        with self._lock:
            return self._episodes.take_turns()

    def continue_episode(self, uid: str, observation_ids) -> bool:
        """Append the observation to a waiting episode and resume decoding its next turn.

        Returns False (and ends the episode, finish_reason 'length') when the observation plus
        one more token does not fit the whole-trajectory budget.
        """
        with self._lock:
            return self._episodes.continue_episode(uid, observation_ids)

    def end_episode(self, uid: str, reason: str = "eos") -> None:
        """Finish a waiting episode: its trajectory comes out of the next step()."""
        with self._lock:
            self._episodes.end_episode(uid, reason)

    def waiting_in_slots(self) -> int:
        """Slots whose episode waits on its environment (released episodes hold none)."""
        return self._episodes.waiting_in_slots()

    def num_waiting(self) -> int:
        """Episodes waiting on their environment (or, released, for a slot)."""
        return self._episodes.waiting_in_slots() + len(self._episodes.released)

    # ---------------------------------------------------------------- weights

    @property
    def version(self) -> int:
        return self._version

    def set_params(self, version: int, params: Any, force: bool = False, inflight: bool = False,
                   now: bool = False) -> bool:
        """Take ``params`` as ``version`` once no live old-version sequence remains (or now, if forced).

        ``inflight=True`` (runtime.mode='inflight'): at the next step, live sequences and all, without
        draining; they go on under the new weights with their KV kept or re-prefilled as
        rollout.inflight_kv says (rollout/inflight.py), each token stamped with its own version.
        ``now``: take it in this call if it can be taken (else at a later step) and wait until its
        weights are on the devices (the runtime measures a swap's stall around it). Returns whether
        the server runs ``version`` on return."""
        with self._lock:
            if version <= self._version:
                raise ValueError(f"set_params(version={version}): must be > current version {self._version}")
            self._pending = (int(version), params, force, inflight)
            if now:
                self._maybe_swap()
                if self._pending is None and self._params is not None:
                    jax.block_until_ready(self._params)
            return self._pending is None

    def _maybe_swap(self) -> None:
        if self._pending is None:
            return
        version, params, force, inflight = self._pending
        if inflight and not force:
            from laminar_jax.rollout.inflight import swap_inflight

            swap_inflight(self, version, params, install)
            return
        if force:
            self._drain()
            for slot, live in enumerate(self._books.slots):
                if live is not None:
                    self._state = self.engine.deactivate(self._state, slot)
                    self._books.retire(slot, "aborted")
            self._episodes.abort_released()
        if self.num_live == 0:
            self._drain()  # the in-flight call (if any) emitted nothing: every slot was already retired
            install(self, version, params)

    def release_params(self) -> None:
        """Free this server's weights now (a server that owns them and is being replaced: its
        successor's version is placed only after). The server cannot generate afterwards."""
        with self._lock:
            if self._params is not None:
                self.engine.placement.release(self._params)
            self._params = None

    # ---------------------------------------------------------------- moving live sequences (moves.py)

    def live_slots(self) -> dict[int, str]:
        with self._lock:
            return {i: x.request.uid for i, x in enumerate(self._books.slots) if x is not None}

    def live_sequences(self) -> list[tuple[int, str, int]]:
        """[(slot, uid, KV pages reserved)] of live sequences: what the repack planner weighs."""
        with self._lock:
            return [(i, x.request.uid, self.engine.schedule.reserve_pages(len(x.prompt), x.sampling.max_new_tokens))
                    for i, x in enumerate(self._books.slots) if x is not None]

    def export_sequence(self, slot: int) -> SequenceState:
        """Take a live sequence out (frees its slot and pages); continue it with import_sequence()."""
        with self._lock:
            return moves.export_sequence(self, slot)

    def import_sequence(self, seq: SequenceState) -> int:
        """Continue an exported sequence here; returns its slot.

        Raises VersionMismatchError (different weights), NoFreeSlotError, OutOfPages: the caller
        keeps the SequenceState and retries or tries another server.
        """
        with self._lock:
            return moves.import_sequence(self, seq)

    # ---------------------------------------------------------------- stats

    def stats(self, wait: bool = True) -> ServerStats:
        """The server's figures now; `wait=False`: without waiting for a step in progress (which holds
        the lock through a generate call's device wait), the figures last taken instead, as the
        process and Ray fleets report their servers' latest poll."""
        if not self._lock.acquire(blocking=wait):
            return self._last_stats
        try:
            self._last_stats = server_stats(self)
            return self._last_stats
        finally:
            self._lock.release()


def install(srv: RolloutServer, version: int, params: Any) -> None:
    """Make ``params`` the weights of ``version`` on ``srv`` (no output in flight: the caller drained
    and holds the server's lock)."""
    if isinstance(params, HostWeights):
        # Streamed in place: no program may still read the old buffers once they are deleted.
        jax.block_until_ready(srv._state)
        params = srv.engine.placement.swap(srv._params, params.tree, params.on_leaf, lora=params.lora)
    srv._params, srv._version, srv._pending = params, version, None
