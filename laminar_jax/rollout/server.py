"""RolloutServer: continuous batching over the engine's slots, weight swaps, live-sequence moves.

Step-driven: ``step()`` = (maybe swap weights) + admission + one generate() dispatch, and returns
the Trajectories that finished. Generation is pipelined: step n dispatches generate call n and
then reads the tokens of call n-1, so the host bookkeeping overlaps the device's work. This is
safe because the device itself retires finished slots (stop id / max_new, see Engine._step): a
slot is only reused after the host has read its ``done`` flag, and an inactive slot writes only
to the null page.

Admission policy: a request is admitted only when its pages for prompt + max_new_tokens can be
reserved up front (no preemption). If the pool is short, the request waits at the head of the
queue (FIFO) until finished sequences return pages; any request that fits in an empty pool is
accepted by submit(), so running out of pages means waiting, never a crash or deadlock.

Weight versions: ``set_params(v, params)`` records a pending version; admission stops; when no
live sequence of the old version remains the swap happens and admission resumes. Params given as
``HostWeights`` (host arrays) are streamed into place at the swap, tensor by tensor, each old
buffer deleted before its replacement is placed: the devices never hold two versions. ``force=True``
swaps at the next step, aborting live old-version sequences (finish_reason='aborted', tokens so
far, stamped with the old version) so no trajectory ever mixes versions.

Multi-turn episodes (Request.turn): a turn ends at a stop id (on the device), a stop sequence
(on the host; the slot is deactivated) or the turn budget; the sequence then *waits*: its slot
and KV pages stay, decode skips it, and a TurnEnd comes out of take_turns(). Its owner runs the
environment elsewhere and calls continue_episode(uid, observation_ids) (engine.extend: the
observation's KV goes into the same pages, decoding resumes) or end_episode(uid). A waiting
sequence is live, so a weight swap waits for it too: one version per trajectory across turns.
Episodes move like other live sequences (export_sequence / import_sequence), waiting or mid-turn:
SequenceState.episode carries their books, and a waiting one is imported parked.
"""

from __future__ import annotations

import collections
import dataclasses
import queue
import threading
import time
import zlib
from typing import Any, Callable, NamedTuple, Optional

import jax
import numpy as np

from laminar_jax.rollout.engine import MAX_STOP_IDS, Engine
from laminar_jax.rollout.paged import OutOfPages, SlotInit
from laminar_jax.rollout.records import (NoFreeSlotError, OverlongPromptError, QueueFullError, Request,
                                         SequenceState, ServerStats, TurnEnd, TurnSpec, VersionMismatchError)
from laminar_jax.rollout.sampling import SamplingParams, default_sampling
from laminar_jax.types import Trajectory

_RATE_WINDOW_S = 5.0


def _default_impl_is_threefry() -> bool:
    """Whether jax.random.key() builds threefry2x32 keys (read per call: the config can change)."""
    return str(jax.config.jax_default_prng_impl) == "threefry2x32"


@dataclasses.dataclass
class _Live:
    """Host bookkeeping of one live sequence (mutable; owned by the server)."""

    request: Request
    prompt: np.ndarray  # i32[P] (after truncation)
    sampling: SamplingParams  # max_new_tokens capped by max_total_len
    key_data: np.ndarray
    version: int
    tokens: list
    logprobs: list
    moves: int = 0
    mask: Optional[list] = None  # multi-turn: 1 per generated token, 0 per observation token
    turn: int = 0  # index of the current policy turn
    turn_start: int = 0  # index in tokens where it began
    waiting: bool = False  # parked on its environment
    turn_end: int = 0  # policy tokens sampled when the current turn's budget runs out (the device's max_new)
    parked_at: int = 0  # the output read (count) that parked it: its slot may go once the next is read
    pages: Optional[list] = None  # KV pages held while it waits without a slot (TurnSpec.release_slot)
    resume: Optional[tuple] = None  # (observation ids, next turn's budget) waiting for a free slot
    prompt_key: Optional[bytes] = None  # set while its slot's pages hold its prompt KV for others to share


@dataclasses.dataclass
class _Admission:
    request: Request
    prompt: np.ndarray
    sampling: SamplingParams
    key_data: np.ndarray
    prompt_key: Optional[bytes] = None  # the prompt's bytes, when its KV may be shared (share_prompt_kv)


class HostWeights(NamedTuple):
    """A version's weights as a host tree shaped like the engine's params, to be streamed onto a
    server's devices at its swap (Engine.swap_params: each old tensor deleted before its
    replacement is placed). on_leaf(i, placed) observes each placement (tests)."""

    tree: Any
    on_leaf: Optional[Callable[[int, Any], None]] = None


class RolloutServer:
    """Continuous-batching server over one Engine. Its owner calls step() (the runtime's
    RolloutWorker, in a supervised thread; the offline front door, in the caller's)."""

    def __init__(self, engine: Engine, params: Any, version: int = 0):
        """params: the engine's params on its devices, or HostWeights (placed now; such a server
        owns its weights and streams every later HostWeights version into place)."""
        self.engine = engine
        self.section = engine.section
        self._params = engine.place_params(params.tree) if isinstance(params, HostWeights) else params
        self._version = int(version)
        self._state = engine.init_decode_state()
        self._slots: list[Optional[_Live]] = [None] * engine.num_slots
        self._queue: queue.Queue = queue.Queue(maxsize=self.section.queue_capacity)
        self._head: Optional[_Admission] = None  # popped from the queue, waiting for pages/slots
        self._pending: Optional[tuple[int, Any, bool]] = None  # (version, params, force)
        self._inflight = None  # StepOutput of the last dispatched generate(), not yet read
        self._finished: list[Trajectory] = []  # produced outside step() (drains, aborts)
        self._lock = threading.RLock()
        self._rate: collections.deque = collections.deque()  # (time, tokens) per step, last _RATE_WINDOW_S
        self._rate_sum = 0  # sum of the tokens in _rate, so stats() is O(1) (it runs every poll)
        self._counts = collections.Counter()
        self._default = default_sampling(self.section, tuple(engine.model_cfg.eos_token_id))
        self._turns: list = []  # TurnEnds not yet taken by the owner
        self._released: dict[str, _Live] = {}  # waiting episodes without a slot (TurnSpec.release_slot), by uid
        self._resume: collections.deque = collections.deque()  # uids of released episodes with their observation
        self._n_consumed = 0  # generate() outputs read so far
        self._holders: dict[bytes, list[int]] = {}  # prompt bytes -> slots holding its KV (share_prompt_kv)
        self._last_stats = self._stats()  # what stats(wait=False) answers while a step holds the lock

    @property
    def device_ids(self) -> tuple:
        """Ids of the devices this server's engine runs on: servers on the same ones share compiled programs."""
        return tuple(d.id for d in self.engine.devices)

    def warmup(self) -> None:
        """Compile the engine's programs for this server's weights (on a throwaway decode state)."""
        with self._lock:
            self.engine.warmup(self._params)

    @classmethod
    def from_model(cls, model, section, version: int = 0, **engine_kwargs) -> "RolloutServer":
        from laminar_jax.rollout.engine import make_engine

        engine, params = make_engine(model, section, **engine_kwargs)
        return cls(engine, params, version)

    # ---------------------------------------------------------------- requests

    def submit(self, request: Request, timeout: Optional[float] = None) -> None:
        """Validate and enqueue. Blocks up to ``timeout`` s for queue space (None = forever)."""
        adm = self._prepare(request)
        try:
            self._queue.put(adm, timeout=timeout)
        except queue.Full:
            raise QueueFullError(f"server {self.section.server_id}: request queue full "
                                 f"(rollout.queue_capacity={self.section.queue_capacity}) after waiting "
                                 f"{timeout}s to submit {request.uid!r}") from None

    def _prepare(self, req: Request) -> _Admission:
        s = self.section
        prompt = np.asarray(req.prompt_ids, np.int32).reshape(-1)
        if len(prompt) == 0:
            raise ValueError(f"request {req.uid!r}: empty prompt")
        if len(prompt) > s.max_prompt_len:
            if s.overlong_prompt == "error":
                self._counts["rejected_overlong"] += 1
                raise OverlongPromptError(f"request {req.uid!r}: prompt has {len(prompt)} tokens > "
                                          f"rollout.max_prompt_len={s.max_prompt_len} "
                                          f"(set rollout.overlong_prompt='truncate' to keep the last tokens)")
            self._counts["truncated_overlong"] += 1
            prompt = prompt[-s.max_prompt_len:]
        sp = req.sampling or self._default
        sp.validate(f"request[{req.uid}].sampling" if req.sampling else "rollout")
        if sp.stop_token_ids is None:  # the request asks for the server's default stop ids (EOS)
            sp = dataclasses.replace(sp, stop_token_ids=self._default.stop_token_ids)
        if len(sp.stop_token_ids) > MAX_STOP_IDS:
            raise ValueError(f"request {req.uid!r}: {len(sp.stop_token_ids)} stop ids; at most {MAX_STOP_IDS}")
        room = s.max_total_len - len(prompt)
        if req.sampling is not None and sp.max_new_tokens > room:
            raise ValueError(f"request {req.uid!r}: sampling.max_new_tokens={sp.max_new_tokens} + prompt of "
                             f"{len(prompt)} tokens exceeds rollout.max_total_len={s.max_total_len} "
                             f"(at most {room} new tokens fit)")
        # The section default (rollout.max_new_tokens) is documented as a cap: it shrinks to fit.
        sp = dataclasses.replace(sp, max_new_tokens=min(sp.max_new_tokens, room))
        # Episodes extend their context past the prompt and move their pages: they neither share nor lend.
        key = prompt.tobytes() if s.share_prompt_kv and req.turn is None else None
        return _Admission(req, prompt, sp, self._key_data(req), key)

    def _key_data(self, req: Request) -> np.ndarray:
        if req.key is not None:
            return np.asarray(req.key, np.uint32)
        if req.seed is not None:
            if 0 <= req.seed < 2**31 and _default_impl_is_threefry():
                # jax.random.key(seed) data for threefry2x32 is [0, seed] (either x64 mode, seeds < 2**31);
                # built here because the eager jax ops cost ~0.5 ms per request (tested against jax).
                return np.array([0, req.seed], np.uint32)
            key = jax.random.key(req.seed)
        else:
            key = jax.random.fold_in(jax.random.key(self.section.seed), zlib.crc32(req.uid.encode()) & 0x7FFFFFFF)
        return np.asarray(jax.random.key_data(key), np.uint32)

    # ---------------------------------------------------------------- the loop

    def step(self) -> list[Trajectory]:
        """One admission pass + one generate() dispatch; returns the trajectories that finished."""
        with self._lock:
            self._maybe_swap()
            self._release_parked()
            self._resume_released()  # before new requests: they hold pages already
            self._admit()
            prev, self._inflight = self._inflight, None
            if any(x is not None and not x.waiting for x in self._slots):
                self._state, self._inflight = self.engine.generate(self._params, self._state)
            if prev is not None:
                self._consume(prev)
            done, self._finished = self._finished, []
            return done

    @property
    def num_live(self) -> int:
        """Live sequences: in slots, and episodes waiting without one (a weight swap waits for all)."""
        return sum(x is not None for x in self._slots) + len(self._released)

    def has_work(self) -> bool:
        """Whether a step() now has anything to do: a step in flight to read, a queued request, a
        released episode to resume, or a sequence in a slot that is not waiting on its environment.
        False while every live sequence waits on its environment, so the owner's loop can sleep
        instead of spinning (four spinning servers took a core from the learner and the envs)."""
        with self._lock:
            return (self._queued_or_inflight() or bool(self._resume)
                    or any(x is not None and not x.waiting for x in self._slots))

    def _queued_or_inflight(self) -> bool:
        """A step in flight, or a request queued or at the head of the queue."""
        return self._inflight is not None or self._head is not None or not self._queue.empty()

    def idle(self) -> bool:
        """Nothing live, nothing queued, nothing in flight."""
        return self.num_live == 0 and not self._queued_or_inflight()

    def _admit(self) -> None:
        if self._pending is not None:
            return  # drain the old version first (contract 1)
        if self.section.batching == "static" and self.num_live:
            return  # static baseline: the next batch starts when the whole batch has finished
        starts: list[tuple[int, _Admission]] = []
        pages_free = self.engine.allocator.num_free
        for slot in (i for i, x in enumerate(self._slots) if x is None):
            adm = self._head
            if adm is None:
                try:
                    adm = self._queue.get_nowait()
                except queue.Empty:
                    break
            need = self.engine.reserve_pages(len(adm.prompt), adm.sampling.max_new_tokens)
            if need > pages_free:
                self._head = adm  # wait (FIFO) for finished sequences to return pages
                break
            self._head = None
            pages_free -= need
            starts.append((slot, adm))
        # A prompt a live slot holds (or one prefilled just before in this pass) is copied, not prefilled.
        fresh, shared, keys = [], [], set(self._holders)
        for start in starts:
            key = start[1].prompt_key
            (shared if key is not None and key in keys else fresh).append(start)
            keys.add(key)
        n = self.section.prefill_rows
        for i in range(0, len(fresh), n):
            self._start(fresh[i:i + n])
        if shared:
            self._state = self.engine.share_prompt(self._state, [self._holders[adm.prompt_key][0] for _, adm in shared],
                                                   [slot for slot, _ in shared], [adm.prompt for _, adm in shared],
                                                   [_slot_init(adm) for _, adm in shared])
            self._counts["prompts_shared"] += len(shared)
            for slot, adm in shared:
                self._occupy(slot, adm)

    def _start(self, starts: list[tuple[int, _Admission]]) -> None:
        """Prefill and insert admissions (one engine call: one prompt, or several with prefill_rows > 1)."""
        inits = [_slot_init(adm) for _, adm in starts]
        if len(starts) == 1:
            self._state = self.engine.prefill_insert(self._params, self._state, starts[0][0], starts[0][1].prompt,
                                                     inits[0])
        else:
            self._state = self.engine.prefill_insert_rows(self._params, self._state, [s for s, _ in starts],
                                                          [adm.prompt for _, adm in starts], inits)
        self._counts["prompts_prefilled"] += len(starts)
        for slot, adm in starts:
            self._occupy(slot, adm)

    def _occupy(self, slot: int, adm: _Admission) -> None:
        """Host books of an admitted sequence; its prompt KV becomes shareable (share_prompt_kv)."""
        sp = adm.sampling
        self._slots[slot] = _Live(adm.request, adm.prompt, sp, adm.key_data, self._version, [], [],
                                  mask=[] if adm.request.turn is not None else None, turn_end=sp.max_new_tokens,
                                  prompt_key=adm.prompt_key)
        if adm.prompt_key is not None:
            self._holders.setdefault(adm.prompt_key, []).append(slot)

    def _vacate(self, slot: int) -> _Live:
        """Empty a slot's host books (its pages are the caller's to free or keep); returns what it held."""
        live, self._slots[slot] = self._slots[slot], None
        if live.prompt_key is not None:
            holders = self._holders[live.prompt_key]
            holders.remove(slot)
            if not holders:
                del self._holders[live.prompt_key]
            live.prompt_key = None
        return live

    def _consume(self, out) -> None:
        """Read one generate() output (blocks on the device) and retire finished sequences."""
        out = jax.device_get(out)
        self._n_consumed += 1
        if np.any(out.overflow):
            raise RuntimeError(f"server {self.section.server_id}: live KV pages exceeded the engine's "
                               "live-page bucket (engine length bookkeeping is wrong; outputs of this call are invalid)")
        n_tokens = 0
        # Python scalars via tolist(): per-element numpy indexing costs ~1 us each, a few % of a step.
        tokens, logprobs, done, stopped = (x.tolist() for x in (out.tokens, out.logprobs, out.done, out.stopped))
        for i in range(out.tokens.shape[0]):
            for slot in np.flatnonzero(out.emitted[i]).tolist():
                live = self._slots[slot]
                if live is None or live.waiting:
                    continue  # decoded past a host-side stop sequence (pipelining): not part of the turn
                live.tokens.append(tokens[i][slot])
                live.logprobs.append(logprobs[i][slot])
                n_tokens += 1
                if live.mask is not None:
                    self._multi_turn_token(slot, live, done[i][slot], stopped[i][slot])
                elif done[i][slot]:
                    self._retire(slot, "eos" if stopped[i][slot] else "length")
        now = time.monotonic()
        self._rate.append((now, n_tokens))
        self._rate_sum += n_tokens
        while self._rate and self._rate[0][0] < now - _RATE_WINDOW_S:
            self._rate_sum -= self._rate.popleft()[1]

    def _retire(self, slot: int, reason: str) -> None:
        live = self._vacate(slot)
        self.engine.free_resource(slot)
        self._emit(live, reason)

    def _emit(self, live: _Live, reason: str) -> None:
        """The finished sequence's trajectory, out of the next step()."""
        self._counts["aborted" if reason == "aborted" else "completed"] += 1
        r = live.request
        extra = {"server_id": self.section.server_id, "moves": live.moves}
        if live.mask is not None:
            extra["turns"] = live.turn + 1
        self._finished.append(Trajectory(
            uid=r.uid, prompt_uid=r.prompt_uid, sample_index=r.sample_index, prompt_ids=live.prompt.copy(),
            response_ids=np.asarray(live.tokens, np.int32), behaviour_logprobs=np.asarray(live.logprobs, np.float32),
            version=live.version, finish_reason=reason, data_source=r.data_source, ground_truth=r.ground_truth,
            extra=extra, policy_mask=None if live.mask is None else np.asarray(live.mask, np.uint8)))

    # ---------------------------------------------------------------- multi-turn episodes

    def _multi_turn_token(self, slot: int, live: _Live, done: bool, stopped: bool) -> None:
        """Book one generated token of an episode; end its turn at a stop id / sequence or the budget."""
        live.mask.append(1)
        if done:
            self._park(slot, "stop" if stopped else "length")
            return
        turn_ids = live.tokens[live.turn_start:]
        for seq in live.request.turn.stop_sequences:
            if len(seq) and len(turn_ids) >= len(seq) and tuple(turn_ids[-len(seq):]) == tuple(seq):
                self._state = self.engine.deactivate(self._state, slot)  # the device cannot see stop sequences
                self._park(slot, "stop")
                return

    def _room(self, live: _Live) -> int:
        """Response tokens the whole-trajectory budget still allows."""
        cap = self.section.max_total_len - len(live.prompt)
        if live.request.turn.max_response_tokens:
            cap = min(cap, live.request.turn.max_response_tokens)
        return cap - len(live.tokens)

    def _park(self, slot: int, reason: str) -> None:
        live = self._slots[slot]
        live.waiting = True
        live.parked_at = self._n_consumed
        self.engine.park(slot)
        self._counts["turns"] += 1
        self._turns.append(TurnEnd(live.request.uid, live.turn, np.asarray(live.tokens[live.turn_start:], np.int32),
                                   reason, len(live.tokens), self._room(live)))

    def take_turns(self) -> list:
        """The TurnEnds since the last call (each sequence named waits for continue/end_episode)."""
        with self._lock:
            out, self._turns = self._turns, []
            return out

    def _waiting_slot(self, uid: str) -> int:
        for slot, live in enumerate(self._slots):
            if live is not None and live.request.uid == uid and live.waiting:
                return slot
        raise KeyError(f"server {self.section.server_id}: no episode {uid!r} waits here")

    def continue_episode(self, uid: str, observation_ids) -> bool:
        """Append the observation to a waiting episode and resume decoding its next turn.

        Returns False (and ends the episode, finish_reason 'length') when the observation plus
        one more token does not fit the whole-trajectory budget.
        """
        with self._lock:
            obs = [int(x) for x in np.asarray(observation_ids, np.int32).reshape(-1)]
            released = self._released.get(uid)
            if released is not None and released.resume is None:
                room = self._room(released) - len(obs)
                if not obs or room < 1:
                    self._end_released(uid, "length")
                    return False
                released.resume = (obs, min(released.request.turn.max_new_tokens, room))
                self._resume.append(uid)  # takes a free slot at the next step (waits for one)
                return True
            self._drain()  # its pipelined overshoot (if any) is read and dropped while it still waits
            slot = self._waiting_slot(uid)
            live = self._slots[slot]
            room = self._room(live) - len(obs)
            if not obs or room < 1:
                self._end(slot, "length")
                return False
            max_new = min(live.request.turn.max_new_tokens, room)
            self._extend(slot, live, obs, max_new)
            return True

    def _extend(self, slot: int, live: _Live, obs: list, max_new: int) -> None:
        """Feed the observation over the slot's cached context and start the next turn."""
        n_gen = len(live.logprobs)
        self._state = self.engine.extend(self._params, self._state, slot, obs, len(live.prompt) + len(live.tokens) - 1,
                                         live.tokens[-1], n_gen, max_new)
        live.tokens.extend(obs)
        live.mask.extend([0] * len(obs))
        live.turn += 1
        live.turn_start = len(live.tokens)
        live.turn_end = n_gen + max_new
        live.waiting = False

    def _release_parked(self) -> None:
        """Waiting episodes that asked for it give their slots up (pages kept), once the device
        output that may still hold a token of theirs (decoded past a host-side stop) has been read."""
        for slot, live in enumerate(self._slots):
            if (live is not None and live.waiting and live.request.turn.release_slot
                    and self._n_consumed > live.parked_at and live.request.uid not in self._released):
                self._state, live.pages = self.engine.detach(self._state, slot)
                self._vacate(slot)
                self._released[live.request.uid] = live

    def _resume_released(self) -> None:
        """Released episodes whose observation came take free slots, first come first served."""
        while self._resume:
            free = [i for i, x in enumerate(self._slots) if x is None]
            if not free:
                return  # waits for a slot
            uid = self._resume[0]
            live, slot = self._released[uid], free[0]
            obs, max_new = live.resume
            sp, n_gen = live.sampling, len(live.logprobs)
            init = SlotInit(live.key_data, sp.temperature, sp.top_k, sp.top_p, n_gen + max_new,
                            np.asarray(sp.stop_token_ids, np.int32), num_generated=n_gen)
            self._state = self.engine.attach(self._state, slot, live.pages, len(live.prompt) + len(live.tokens) - 1,
                                             live.tokens[-1], init)
            try:
                self._extend(slot, live, obs, max_new)
            except OutOfPages:
                self._state, _ = self.engine.detach(self._state, slot)  # the pool is short: try again next step
                return
            self._resume.popleft()
            del self._released[uid]
            live.pages, live.resume = None, None
            self._slots[slot] = live

    def _end_released(self, uid: str, reason: str) -> None:
        live = self._released.pop(uid)
        if uid in self._resume:
            self._resume.remove(uid)
        self.engine.allocator.free(live.pages)
        live.pages = None
        self._emit(live, reason)

    def end_episode(self, uid: str, reason: str = "eos") -> None:
        """Finish a waiting episode: its trajectory comes out of the next step()."""
        with self._lock:
            if uid in self._released:
                self._end_released(uid, reason)
                return
            self._end(self._waiting_slot(uid), reason)

    def _end(self, slot: int, reason: str) -> None:
        self._retire(slot, reason)

    def waiting_in_slots(self) -> int:
        """Slots whose episode waits on its environment (released episodes hold none)."""
        return sum(x is not None and x.waiting for x in self._slots)

    def num_waiting(self) -> int:
        """Episodes waiting on their environment (or, released, for a slot)."""
        return sum(x is not None and x.waiting for x in self._slots) + len(self._released)

    def _drain(self) -> None:
        """Read the in-flight output so host bookkeeping matches the device exactly."""
        if self._inflight is not None:
            prev, self._inflight = self._inflight, None
            self._consume(prev)

    # ---------------------------------------------------------------- weights

    @property
    def version(self) -> int:
        return self._version

    def set_params(self, version: int, params: Any, force: bool = False) -> None:
        """Take ``params`` as ``version`` once no live old-version sequence remains (or now, if forced)."""
        with self._lock:
            if version <= self._version:
                raise ValueError(f"set_params(version={version}): must be > current version {self._version}")
            self._pending = (int(version), params, force)

    def _maybe_swap(self) -> None:
        if self._pending is None:
            return
        version, params, force = self._pending
        if force:
            self._drain()
            for slot, live in enumerate(self._slots):
                if live is not None:
                    self._state = self.engine.deactivate(self._state, slot)
                    self._retire(slot, "aborted")
            for uid in list(self._released):
                self._end_released(uid, "aborted")
        if self.num_live == 0:
            self._drain()  # the in-flight call (if any) emitted nothing: every slot was already retired
            if isinstance(params, HostWeights):
                # Streamed in place: no program may still read the old buffers once they are deleted.
                jax.block_until_ready(self._state)
                params = self.engine.swap_params(self._params, params.tree, params.on_leaf)
            self._params, self._version, self._pending = params, version, None

    def release_params(self) -> None:
        """Free this server's weights now (a server that owns them and is being replaced: its
        successor's version is placed only after). The server cannot generate afterwards."""
        with self._lock:
            if self._params is not None:
                self.engine.release_params(self._params)
            self._params = None

    # ---------------------------------------------------------------- moving live sequences

    def live_slots(self) -> dict[int, str]:
        with self._lock:
            return {i: x.request.uid for i, x in enumerate(self._slots) if x is not None}

    def live_sequences(self) -> list[tuple[int, str, int]]:
        """[(slot, uid, KV pages reserved)] of live sequences: what the repack planner weighs."""
        with self._lock:
            return [(i, x.request.uid, self.engine.reserve_pages(len(x.prompt), x.sampling.max_new_tokens))
                    for i, x in enumerate(self._slots) if x is not None]

    def export_sequence(self, slot: int) -> SequenceState:
        """Take a live sequence out (frees its slot and pages); continue it with import_sequence()."""
        with self._lock:
            self._drain()
            live = self._slots[slot]
            if live is None:
                raise KeyError(f"server {self.section.server_id}: slot {slot} holds no live sequence "
                               "(it may have just finished; its trajectory comes out of the next step())")
            if live.mask is not None and any(t.uid == live.request.uid for t in self._turns):
                raise KeyError(f"server {self.section.server_id}: episode {live.request.uid!r} ended a turn "
                               "not yet taken (take_turns() first: its environment must get the turn)")
            self._state = self.engine.deactivate(self._state, slot)
            num_cached = len(live.prompt) + len(live.tokens) - 1
            k, v = self.engine.read_slot(self._state, slot, num_cached)
            self._vacate(slot)
            self.engine.free_resource(slot)
            r = live.request
            return SequenceState(
                uid=r.uid, prompt_uid=r.prompt_uid, sample_index=r.sample_index, data_source=r.data_source,
                ground_truth=r.ground_truth, version=live.version, prompt_ids=live.prompt.copy(),
                generated_ids=np.asarray(live.tokens, np.int32), logprobs=np.asarray(live.logprobs, np.float32),
                key_data=live.key_data.copy(), num_cached=num_cached, sampling=live.sampling,
                page_size=self.engine.page_size, k_pages=k, v_pages=v, moves=live.moves + 1,
                episode=None if live.mask is None else _episode_books(live))

    def import_sequence(self, seq: SequenceState) -> int:
        """Continue an exported sequence here; returns its slot.

        Raises VersionMismatchError (different weights), NoFreeSlotError, OutOfPages: the caller
        keeps the SequenceState and retries or tries another server.
        """
        with self._lock:
            if seq.version != self._version:
                raise VersionMismatchError(f"server {self.section.server_id} runs version {self._version}; "
                                           f"sequence {seq.uid!r} was generated by version {seq.version}")
            if seq.page_size != self.engine.page_size:
                raise ValueError(f"sequence {seq.uid!r}: page_size={seq.page_size}, "
                                 f"this server uses {self.engine.page_size}")
            free = [i for i, x in enumerate(self._slots) if x is None]
            if not free:
                raise NoFreeSlotError(f"server {self.section.server_id}: all {len(self._slots)} slots busy")
            slot = free[0]
            if seq.episode is not None:
                return self._import_episode(slot, seq)
            sp = seq.sampling
            n_gen = len(seq.generated_ids)
            if n_gen >= sp.max_new_tokens:
                raise ValueError(f"sequence {seq.uid!r} already has {n_gen} >= max_new_tokens tokens")
            init = SlotInit(seq.key_data, sp.temperature, sp.top_k, sp.top_p, sp.max_new_tokens,
                            np.asarray(sp.stop_token_ids, np.int32), num_generated=n_gen)
            self._state = self.engine.write_slot(self._state, slot, seq.k_pages, seq.v_pages, seq.num_cached,
                                                 seq.last_token, len(seq.prompt_ids), init)
            req = Request(uid=seq.uid, prompt_ids=seq.prompt_ids, prompt_uid=seq.prompt_uid,
                          sample_index=seq.sample_index, sampling=sp, data_source=seq.data_source,
                          ground_truth=seq.ground_truth)
            self._slots[slot] = _Live(req, np.asarray(seq.prompt_ids, np.int32), sp, seq.key_data, seq.version,
                                      [int(x) for x in seq.generated_ids], [float(x) for x in seq.logprobs],
                                      moves=seq.moves)
            return slot

    def _import_episode(self, slot: int, seq: SequenceState) -> int:
        """Continue a moved episode in `slot`: mid-turn it decodes on to its turn's end; waiting, it
        is written then parked (KV pages kept, device inactive) for continue_episode / end_episode."""
        ep, sp = seq.episode, seq.sampling
        mask = [int(x) for x in ep["mask"]]
        n_gen, n_obs = len(seq.logprobs), mask.count(0)
        if len(mask) != len(seq.generated_ids) or n_gen != len(mask) - n_obs:
            raise ValueError(f"episode {seq.uid!r}: policy mask of {len(mask)} entries ({n_obs} observation) "
                             f"does not match {len(seq.generated_ids)} tokens and {n_gen} log-probs")
        turn_end = n_gen if ep["waiting"] else int(ep["turn_end"])
        if not ep["waiting"] and turn_end <= n_gen:
            raise ValueError(f"episode {seq.uid!r}: turn ends at {turn_end} policy tokens, has {n_gen} already")
        init = SlotInit(seq.key_data, sp.temperature, sp.top_k, sp.top_p, turn_end,
                        np.asarray(sp.stop_token_ids, np.int32), num_generated=n_gen)
        # Pages for the context and the rest of this turn: observation tokens count as prompt here.
        self._state = self.engine.write_slot(self._state, slot, seq.k_pages, seq.v_pages, seq.num_cached,
                                             seq.last_token, len(seq.prompt_ids) + n_obs, init)
        if ep["waiting"]:
            self._state = self.engine.deactivate(self._state, slot)
            self.engine.park(slot)
        spec = ep["turn_spec"]
        turn = TurnSpec(int(spec["max_new_tokens"]), tuple(tuple(int(t) for t in q) for q in spec["stop_sequences"]),
                        int(spec["max_response_tokens"]), bool(spec.get("release_slot", False)))
        req = Request(uid=seq.uid, prompt_ids=seq.prompt_ids, prompt_uid=seq.prompt_uid, sample_index=seq.sample_index,
                      sampling=sp, data_source=seq.data_source, ground_truth=seq.ground_truth, turn=turn)
        self._slots[slot] = _Live(req, np.asarray(seq.prompt_ids, np.int32), sp, seq.key_data, seq.version,
                                  [int(x) for x in seq.generated_ids], [float(x) for x in seq.logprobs],
                                  moves=seq.moves, mask=mask, turn=int(ep["turn"]), turn_start=int(ep["turn_start"]),
                                  waiting=bool(ep["waiting"]), turn_end=turn_end,
                                  parked_at=self._n_consumed - 1)  # no output of ours in flight: may release now
        return slot

    # ---------------------------------------------------------------- stats

    def stats(self, wait: bool = True) -> ServerStats:
        """The server's figures now; `wait=False`: without waiting for a step in progress (which holds
        the lock through a generate call's device wait), the figures last taken instead, as the
        process and Ray fleets report their servers' latest poll."""
        if not self._lock.acquire(blocking=wait):
            return self._last_stats
        try:
            self._last_stats = self._stats()
            return self._last_stats
        finally:
            self._lock.release()

    def _stats(self) -> ServerStats:  # under the lock
        per_version = collections.Counter(x.version for x in [*self._slots, *self._released.values()]
                                          if x is not None)
        span = (self._rate[-1][0] - self._rate[0][0]) if len(self._rate) > 1 else 0.0
        # Tokens after the first entry over the span they were produced in.
        rate = (self._rate_sum - self._rate[0][1]) / span if span > 0 else 0.0
        alloc = self.engine.allocator
        return ServerStats(
            server_id=self.section.server_id, version=self._version, slots_used=sum(x is not None for x in self._slots),
            slots_total=len(self._slots), kv_pages_used=alloc.num_used, kv_pages_total=alloc.num_pages - 1,
            live_per_version=dict(per_version), tokens_per_s=rate,
            queue_length=self._queue.qsize() + (self._head is not None),
            pending_version=None if self._pending is None else self._pending[0],
            completed=self._counts["completed"], rejected_overlong=self._counts["rejected_overlong"],
            truncated_overlong=self._counts["truncated_overlong"], aborted=self._counts["aborted"],
            prompts_prefilled=self._counts["prompts_prefilled"], prompts_shared=self._counts["prompts_shared"],
            decode_kernel=self.engine.kernels.summary())


def _slot_init(adm: _Admission) -> SlotInit:
    sp = adm.sampling
    return SlotInit(adm.key_data, sp.temperature, sp.top_k, sp.top_p, sp.max_new_tokens,
                    np.asarray(sp.stop_token_ids, np.int32))


def _episode_books(live: _Live) -> dict:
    """A live episode's host books as JSON data (SequenceState.episode): what import needs to go on."""
    t = live.request.turn
    return {"turn_spec": {"max_new_tokens": int(t.max_new_tokens),
                          "stop_sequences": [[int(x) for x in q] for q in t.stop_sequences],
                          "max_response_tokens": int(t.max_response_tokens), "release_slot": bool(t.release_slot)},
            "mask": [int(x) for x in live.mask], "turn": live.turn, "turn_start": live.turn_start,
            "turn_end": live.turn_end, "waiting": live.waiting}
