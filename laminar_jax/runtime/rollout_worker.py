"""Drives one rollout server: pull weights when the mode allows, take work, step, hand results on.

The same loop in both runtimes. It talks to the buffer service through four calls (`take_work`,
`complete`, `report`, `register`), made in-process by the local runtime and through `RemoteBuffer`
by a Ray rollout actor. The decisions (admit? swap?) are the pure mode policies in
laminar_jax.scheduler.modes; this module only does the I/O around them.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Any, Callable

import numpy as np

from laminar_jax.monitor import profile
from laminar_jax.weights.prefetch import Prefetcher
from laminar_jax.types import Trajectory, WorkItem
from laminar_jax.scheduler.modes import ModePolicy, server_may_admit, swap_now

log = logging.getLogger(__name__)


class InjectedFault(RuntimeError):
    """Raised on purpose by fault-injection tests and the faults benchmark."""


class BoardView:
    """A server's copy of the board: its own entry is local truth; the others' versions and live
    counts are refreshed through `buffer.report` at most every `sync_s` (and at once when this
    server's version changes). A lagging view never breaks a contract: the buffer re-checks
    admission when work is taken, and a server swaps only with no live sequence of its own."""

    def __init__(self, buffer, index: int, name: str, version: int, sync_s: float):
        self.buffer, self.index, self.name, self.sync_s = buffer, index, name, sync_s
        self.newest = self.learner_version = version
        self._mine = (version, 0)
        self._others: list[tuple[int, int]] = []
        self._last_sync = -float("inf")

    def update(self, version: int, live: int) -> None:
        changed = version != self._mine[0]
        self._mine = (version, live)
        if changed or time.monotonic() - self._last_sync >= self.sync_s:
            view = self.buffer.report(self.index, self.name, version, live)
            self.newest = max(self.newest, view["newest"])
            self.learner_version = view["learner_version"]
            self._others = [tuple(x) for x in view["others"]]
            self._last_sync = time.monotonic()

    def set_newest(self, v: int) -> None:
        self.newest = max(self.newest, v)

    def global_pending(self) -> bool:
        return any(v < self.newest for v, _ in [self._mine, *self._others])

    def live_counts(self) -> list[int]:
        return [n for _, n in [self._mine, *self._others]]


def make_request(item: Trajectory | WorkItem):
    """The engine's request for a sample (its record, or an eval round's work item): the prompt and
    its seed (nothing the reward needs), and an eval item's own sampling (greedy or the eval
    temperature; None: the server's defaults)."""
    from laminar_jax.rollout.records import Request

    return Request(uid=item.uid, prompt_ids=np.asarray(item.prompt_ids, np.int32), prompt_uid=item.prompt_uid,
                   sample_index=item.sample_index, seed=item.seed, sampling=getattr(item, "sampling", None))


class RolloutWorker:
    """One server's loop. `lock` is held for each iteration so repack moves see a still server."""

    def __init__(self, index: int, name: str, server, client, buffer, policy: ModePolicy,
                 params_from_flat: Callable[[dict], Any], *, pull_timeout_s: float, board_sync_s: float = 0.0,
                 timeline=None, poll_s: float = 0.05, episodes=None, prefetch: bool = False,
                 prefetch_device: bool = False):
        """prefetch: stage each newer version in the background while draining (weights/prefetch.py;
        rollout.prefetch); prefetch_device: stage it on the devices too (rollout.prefetch_device)."""
        self.index, self.name, self.server, self.client = index, name, server, client
        self.buffer, self.policy = buffer, policy
        self.params_from_flat = params_from_flat
        self.timeline = timeline
        self.poll_s, self.pull_timeout_s = poll_s, pull_timeout_s
        self.board = BoardView(buffer, index, name, server.version, board_sync_s)
        self.lock = threading.RLock()
        self.killed = threading.Event()  # declared dead: its loop exits and its results are dropped
        self.crash_next = False  # fault injection: the next iteration raises (a crashed server)
        self.last_beat = time.monotonic()  # heartbeat: refreshed every iteration
        self._last_poll = -float("inf")
        self.swaps = 0
        self.pull_timeouts = 0  # pulls of a newer version that timed out (the loop went on and retried)
        self.dropped = 0  # results the buffer refused (this server had been declared dead)
        self.episodes = episodes  # an EpisodeFeed (multi-turn episodes) or None (single-turn completions)
        self.prefetch_device = prefetch_device
        self.prefetch = Prefetcher(name, self._stage) if prefetch else None
        # Swaps: (time.time() when drained and ready, stall s until serving the new version, version,
        # staged ahead: the version was fully staged when the drain ended). Remote fleets read them
        # through take_swaps(); a local worker also puts them on its timeline.
        self._swap_log: list[tuple[float, float, int, bool]] = []

    def _poll_newest(self) -> None:
        now = time.monotonic()
        if now - self._last_poll >= self.poll_s:
            self._last_poll = now
            v = self.client.latest_version(timeout=self.pull_timeout_s)
            if v is not None:
                self.board.set_newest(v)

    def _maybe_swap(self) -> None:
        s = self.server
        if s.version >= self.board.newest:
            return
        if self.prefetch is not None:  # also while it admits under admit_lag: it swaps once its work runs out
            self.prefetch.announce(self.board.newest, s.version)
        if not swap_now(self.policy, s.num_live, self.board.live_counts()):
            return
        t_ready, wall_ready = time.monotonic(), time.time()
        staged = self.prefetch.take(s.version, self.pull_timeout_s) if self.prefetch is not None else None
        # Placed on this server's devices (with a hand-off, once per version for every server that
        # places the same way: they share one copy).
        try:
            if staged is not None:
                version, params = staged.version, self._unstage(staged.version, staged.payload)
            else:  # no prefetch, or it failed: pulled now, within what is left of one pull's time
                left = self.pull_timeout_s - (time.monotonic() - t_ready)
                version, params = self.client.pull_placed(s.version, max(0.0, left), self.params_from_flat)
        except TimeoutError as e:
            # Not this server's failure: a learner group that died after announcing a version that
            # reached neither relay nor store publishes it again only once its replacement has
            # replayed to it, which took longer than one pull under load. The server keeps its version
            # (and its heartbeat) and pulls again next iteration; a run whose weights never come ends
            # on the learner's and the buffer's own wait timeouts.
            self.pull_timeouts += 1
            log.warning("rollout server %s: %s; pulling again (timeout %d)", self.name, e, self.pull_timeouts)
            return
        # nothing live holds the old version (swap_now), or runtime.mode='inflight': taken now
        s.set_params(version, params, inflight=self.policy.swap == "inflight", now=True)
        stall = time.monotonic() - t_ready
        ahead = staged is not None and staged.t_done <= t_ready
        self.swaps += 1
        if self.timeline is not None:
            self.timeline.swap(wall_ready, self.name, stall, version, ahead)
        else:
            self._swap_log.append((wall_ready, stall, version, ahead))

    def _stage(self, newer_than: int) -> tuple[int, Any]:
        """The prefetch thread's fetch: pull the newest version > newer_than and do what of its
        placement stays off the devices now (the host tree and cast of a server that streams its
        weights in at the swap); with prefetch_device, place it on the devices as well."""
        version, flat = self.client.pull(newer_than, timeout=self.pull_timeout_s)
        source = getattr(self.client, "last_source", None)
        if getattr(self.params_from_flat, "on_host", False):
            params = self.params_from_flat(flat)  # HostWeights: host work only
            if self.prefetch_device and params.lora is None:  # a LoRA version is merged into the base at the swap
                params = self.server.engine.placement.place(params.tree)
            return version, ("placed", params)
        if self.prefetch_device:  # placing is a device copy: made now only where the plan counts it
            return version, ("placed", self.client.placed(version, flat, self.params_from_flat, source))
        return version, ("flat", flat, source)

    def _unstage(self, version: int, payload: tuple) -> Any:
        """A staged version's params for set_params: the staged placement, or the placement now."""
        if payload[0] == "placed":
            return payload[1]
        _, flat, source = payload
        return self.client.placed(version, flat, self.params_from_flat, source)

    def take_swaps(self) -> list[tuple[float, float, int, bool]]:
        """The swaps recorded since the last call (a remote fleet's poll puts them on its timeline)."""
        with self.lock:
            out, self._swap_log = self._swap_log, []
            return out

    def close(self, timeout: float = 30.0) -> bool:
        """Stop the prefetch thread (joined) and close the client's kept connections; whether the
        thread ended within ``timeout`` s."""
        joined = self.prefetch.close(timeout) if self.prefetch is not None else True
        if self.client is not None:
            self.client.close()
        return joined

    def admitting(self) -> bool:
        """Whether the mode lets this server take new prompts now (else it drains to swap)."""
        return server_may_admit(self.policy, self.server.version, self.board.newest, self.board.global_pending())

    def _admit(self) -> None:
        s = self.server
        if not self.admitting():
            return
        st = s.stats()
        free = st.slots_total - st.slots_used - st.queue_length
        if self.episodes is not None:
            free -= self.episodes.starting()  # episodes whose environment is still resetting
        for item in self.buffer.take_work(self.index, self.name, s.version, free) if free > 0 else []:
            if self.episodes is not None:
                self.episodes.start(item)
            else:
                s.submit(make_request(item), timeout=self.pull_timeout_s)

    def iterate(self) -> bool:
        """One iteration; returns True when the server has more to do right away (else the loop naps)."""
        with self.lock:
            self.last_beat = time.monotonic()
            if self.crash_next:
                raise InjectedFault(f"injected crash of rollout server {self.name}")
            s = self.server
            with profile.phase("poll"):
                self._poll_newest()
            with profile.phase("pull"):
                self._maybe_swap()
            with profile.phase("dispatch"):
                self._admit()
            with profile.phase("decode"):
                done = s.step()
            if self.episodes is not None:
                done = self.episodes.step(s, done)
            if self.killed.is_set():
                return False  # declared dead meanwhile: its work was requeued, drop these results
            with profile.phase("dispatch"):
                self._hand_on(done)
            # Live episodes that all wait on their environments are not work: the loop sleeps a
            # few ms between polls of their replies instead of spinning on the GIL.
            return bool(done) or s.has_work()

    def _hand_on(self, done: list) -> None:
        """Results to the buffer (which scores them), this server's entry on the board, the timeline."""
        s = self.server
        for traj in done:
            if not self.buffer.complete(self.name, traj):
                self.dropped += 1
        self.board.update(s.version, s.num_live)
        if self.timeline is not None:
            st = s.stats()
            self.timeline.sample(time.time(), self.name, st.slots_used, st.slots_total, s.version,
                                 st.kv_pages_used, st.kv_pages_total)
            if self.episodes is not None and hasattr(self.timeline, "sample_waiting"):
                self.timeline.sample_waiting(self.name, s.waiting_in_slots(), self.episodes.driver.stats())

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set() and not self.killed.is_set():
            if not self.iterate():
                time.sleep(0.005)

    def snapshot(self) -> dict:
        """Heartbeat + what the scheduler weighs (plain data): ServerStats, live sequences with their
        KV pages, the loop's silence, whether it drains to swap."""
        with self.lock:
            s = self.server
            return {"stats": dataclasses.asdict(s.stats()), "seqs": [(uid, p) for _, uid, p in s.live_sequences()],
                    "beat_age": time.monotonic() - self.last_beat, "draining": not self.admitting(),
                    "swaps": self.swaps, "pull_timeouts": self.pull_timeouts, "dropped": self.dropped,
                    "prefetch": None if self.prefetch is None else self.prefetch.stats()}

    def export_sequence(self, uid: str, version: int, portable: bool = False):
        """Take live sequence `uid` out (a SequenceState); None if it finished (also inside the step
        still in flight), or if this server no longer runs `version` (the plan is stale).

        A multi-turn episode (waiting on its environment or decoding) leaves with its environment
        side as the state's in-process `handoff`; `portable=True` (the state will be pickled to
        another process) keeps episodes here: an environment and its running step stay in-process.
        """
        with self.lock:
            s = self.server
            slot = {u: i for i, u, _ in s.live_sequences()}.get(uid)
            if slot is None or s.version != version:
                return None
            driver = self.episodes.driver if self.episodes is not None else None
            if portable and driver is not None and driver.owns(uid):
                return None
            try:
                state = s.export_sequence(slot)
            except KeyError:
                return None
            if state.episode is not None and driver is not None:
                state = dataclasses.replace(state, handoff=driver.release(uid))
            return state

    def import_sequence(self, state) -> int:
        """Continue a moved sequence here; raises (VersionMismatchError, NoFreeSlotError, ...) if it cannot."""
        with self.lock:
            if state.episode is not None and (self.episodes is None or state.handoff is None):
                raise ValueError(f"episode {state.uid!r} arrived without its environment side (moved across "
                                 "processes, or to a server that runs no episodes)")
            slot = self.server.import_sequence(state)
            if state.episode is not None:
                self.episodes.driver.adopt(state.uid, state.handoff)
            return slot


def pull_timeout(cfg) -> float:
    """How long a server waits for a weight pull: below the heartbeat timeout, so a relay that
    missed a version is given up on (falling back to the weight store) before the server is
    declared dead; and never beyond the runtime's bound on any wait."""
    return min(cfg.runtime.wait_timeout_s, 120.0, cfg.scheduler.heartbeat_timeout_s / 2)


class EpisodeFeed:
    """The worker's multi-turn side: work items become episodes (EpisodeDriver), rewards come from
    the environments. An environment is chosen and reset with the sample's `episode_record()`, read off
    its record; `record_of(uid)` gives them for a work item that is not a record."""

    def __init__(self, driver, record_of: Callable[[str], dict], turn):
        self.driver, self.record_of, self.turn = driver, record_of, turn

    def start(self, item: Trajectory | WorkItem) -> None:
        req = dataclasses.replace(make_request(item), turn=self.turn)
        # A sample's record carries its prompt's fields; only another work item's are looked up.
        record = item.episode_record() if isinstance(item, Trajectory) else self.record_of(item.uid)
        self.driver.start(req, dict(record, uid=item.uid))

    def starting(self) -> int:
        return self.driver.starting()

    def step(self, server, done: list) -> list:
        self.driver.poll(server)
        return self.driver.finish(done)


def check_env_sandbox(e) -> None:
    """Before any episode: env.sandbox='bwrap' with bwrap unusable fails the run here, saying how to fix it,
    when the config names an environment that takes a sandbox; 'none' is logged as a warning."""
    if e.sandbox == "none":
        log.warning("env.sandbox='none': model-written code runs UNSANDBOXED, in this process's user and namespaces")
        return
    from laminar_jax.env.bwrap import check_sandbox
    from laminar_jax.env.registry import accepts

    named = {e.default, *(e.by_data_source or {}).values(), *(e.env_kwargs or {})} - {None}
    if any(accepts(n, "sandbox") for n in named):
        check_sandbox(e.sandbox)


def episode_feed(cfg, tokenizer, record_of: Callable[[str], dict]):
    """An EpisodeFeed for cfg.env (None when env.enabled is False); its EnvPool dies with the process."""
    if not cfg.env.enabled:
        return None
    from laminar_jax.env import EnvPool
    from laminar_jax.env.driver import EpisodeDriver
    from laminar_jax.rollout.records import TurnSpec

    e = cfg.env
    check_env_sandbox(e)
    driver = EpisodeDriver(EnvPool(e.workers, e.timeout_s), tokenizer, default_env=e.default,
                           by_data_source=e.by_data_source, chat_template=e.chat_template, env_kwargs=e.env_kwargs,
                           sandbox=e.sandbox)
    stop = tuple(tokenizer.encode(e.turn_stop))
    return EpisodeFeed(driver, record_of, TurnSpec(e.turn_max_new_tokens, (stop,), e.max_response_tokens,
                                                   release_slot=e.release_slot_while_waiting))
