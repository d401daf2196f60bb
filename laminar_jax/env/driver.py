"""EpisodeDriver: the rollout worker's side of multi-turn episodes.

Between server steps (on the worker's thread) it takes the server's TurnEnds, sends each turn's
text to the episode's environment in the EnvPool (never on this thread), and applies the
answers: an observation is rendered as a tool message, tokenised and appended with
server.continue_episode; done ends the episode. Its reward, the sum of the step rewards, is
stamped on the trajectory when the server hands it out (finish()).

Failures never stop the run and lose no episode: an environment that raises, hangs past the
pool's deadline or returns something malformed ends its episode (after the current turn) with
reward 0, counted in stats().env_failures. A reset that fails does the same after one turn.
"""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import Future
from typing import Any, Callable, NamedTuple, Optional

import numpy as np

from laminar_jax.env.base import Environment, check_reset, check_step
from laminar_jax.env.pool import EnvPool
from laminar_jax.env.registry import make_env, select_env
from laminar_jax.env.tools import TOOL_CALL_START, render_tool_message


@dataclasses.dataclass
class _Episode:
    name: str
    env: Optional[Environment]
    request: Any  # the rollout Request, submitted once reset answered
    pending: Optional[Future] = None  # the reset or step running in the pool
    waiting_since: float = 0.0
    reward: float = 0.0
    failed: Optional[str] = None
    turns: int = 0
    tool_calls: int = 0
    env_wait_s: float = 0.0
    submitted: bool = False


class DriverStats(NamedTuple):
    episodes_done: int
    turns_per_episode: float  # mean over finished episodes
    tool_call_rate: float  # share of policy turns that wrote a <tool_call>
    env_failures: int
    env_latency_p50_s: float
    env_latency_p99_s: float
    env_wait_slot_s: float  # slot-seconds sequences spent waiting on environments
    waiting_now: int


def _step(env: Environment, name: str, text: str):
    return check_step(env.step(text), name)


def _reset(factory: Callable[[], Environment], name: str, record: dict):
    env = factory()
    return env, check_reset(env.reset(record), name)


class EpisodeDriver:
    def __init__(self, pool: EnvPool, tokenizer, *, default_env: Optional[str] = None,
                 by_data_source: Optional[dict] = None, chat_template: Optional[str] = None,
                 env_kwargs: Optional[dict] = None, sandbox: str = "bwrap",
                 clock: Callable[[], float] = time.monotonic):
        self.pool, self.tokenizer, self.clock = pool, tokenizer, clock
        self.default_env, self.by_data_source, self.chat_template = default_env, by_data_source or {}, chat_template
        self.env_kwargs = {k: dict(v) for k, v in (env_kwargs or {}).items()}
        self.sandbox = sandbox
        self._eps: dict[str, _Episode] = {}
        self._done = self._turns = self._tool_turns = self._failures = 0
        self._wait_slot_s = 0.0

    # -------------------------------------------------------------- episode life

    def start(self, request, record: dict) -> None:
        """Begin an episode for `request` (a rollout Request with .turn set): its env resets in the pool."""
        name, kwargs = select_env(record, self.default_env, self.by_data_source)
        # The config's sandbox setting wins over a record's: data cannot turn the sandbox off.
        kwargs = {**self.env_kwargs.get(name, {}), **kwargs, "sandbox": self.sandbox}
        ep = _Episode(name, None, request)
        ep.pending = self.pool.submit(_reset, lambda: make_env(name, **kwargs), name, record)
        self._eps[request.uid] = ep

    def poll(self, server) -> None:
        """Submit reset episodes, route ended turns to their envs, apply finished env calls."""
        for uid, ep in list(self._eps.items()):
            if not ep.submitted and ep.pending is not None and ep.pending.done():
                self._submit(server, ep)
        for turn in server.take_turns():
            self._on_turn(server, turn)
        for uid, ep in list(self._eps.items()):
            if ep.submitted and ep.pending is not None and ep.pending.done():
                self._on_answer(server, uid, ep)

    def _submit(self, server, ep: _Episode) -> None:
        res, ep.pending = ep.pending.result(), None
        req = ep.request
        if res.ok:
            ep.env, first = res.value
            if first:
                ids = list(np.asarray(req.prompt_ids).tolist()) + list(self.tokenizer.encode(first))
                req = dataclasses.replace(req, prompt_ids=np.asarray(ids, np.int32))
        else:
            self._fail(ep, res.error)
        server.submit(req, timeout=30.0)
        ep.submitted = True

    def _on_turn(self, server, turn) -> None:
        ep = self._eps.get(turn.uid)
        if ep is None:
            server.end_episode(turn.uid)  # not ours (a resumed run's leftover): finish it as generated
            return
        text = self.tokenizer.decode([t for t in turn.turn_ids.tolist() if t != self.tokenizer.eos_id])
        ep.turns += 1
        ep.tool_calls += int(TOOL_CALL_START in text)
        if ep.failed is not None or ep.env is None:
            server.end_episode(turn.uid)
            return
        ep.waiting_since = self.clock()
        ep.pending = self.pool.submit(_step, ep.env, ep.name, text)

    def _on_answer(self, server, uid: str, ep: _Episode) -> None:
        res, ep.pending = ep.pending.result(), None
        waited = self.clock() - ep.waiting_since
        ep.env_wait_s += waited
        self._wait_slot_s += waited
        if not res.ok:
            self._fail(ep, res.error)
            server.end_episode(uid)
            return
        obs, reward, done = res.value
        ep.reward += reward
        if done:
            server.end_episode(uid)
            return
        ids = self.tokenizer.encode(render_tool_message(obs, self.tokenizer, self.chat_template))
        server.continue_episode(uid, ids)  # False: the trajectory budget ended it (finish_reason 'length')

    def _fail(self, ep: _Episode, error: Optional[str]) -> None:
        ep.failed = error or "failed"
        self._failures += 1

    def finish(self, trajectories: list) -> list:
        """Stamp each finished episode's reward (0 after a failure) and figures; close its env in the pool."""
        out = []
        for traj in trajectories:
            ep = self._eps.pop(traj.uid, None)
            if ep is None:
                out.append(traj)
                continue
            self._done += 1
            self._turns += ep.turns
            self._tool_turns += ep.tool_calls
            if ep.env is not None:
                self.pool.submit(ep.env.close)
            reward = 0.0 if ep.failed is not None else ep.reward
            extra = dict(traj.extra, env=ep.name, turns=ep.turns, tool_calls=ep.tool_calls,
                         env_wait_s=round(ep.env_wait_s, 4), env_error=ep.failed)
            out.append(dataclasses.replace(traj, reward=float(reward), extra=extra))
        return out

    def starting(self) -> int:
        """Episodes whose environment is still resetting (not yet submitted to the server)."""
        return sum(1 for ep in self._eps.values() if not ep.submitted)

    def owns(self, uid: str) -> bool:
        return uid in self._eps

    def release(self, uid: str) -> Optional[_Episode]:
        """Hand an episode over (its sequence moves to another server): its env, the step it may be
        running and its figures go with it; adopt() on the destination's driver takes them on."""
        return self._eps.pop(uid, None)

    def adopt(self, uid: str, episode: _Episode) -> None:
        """Take on a moved episode: its env's answer (or its finished trajectory) is handled here now."""
        if not isinstance(episode, _Episode) or not episode.submitted:
            raise ValueError(f"episode {uid!r}: adopt() takes what release() returned for a submitted episode")
        self._eps[uid] = episode

    def forget(self, uid: str) -> None:
        """Drop an episode whose sequence left this server (killed server: the work is requeued)."""
        self._eps.pop(uid, None)

    def stats(self) -> DriverStats:
        p = self.pool.stats()
        n = max(self._done, 1)
        waiting = sum(1 for ep in self._eps.values() if ep.submitted and ep.pending is not None)
        return DriverStats(self._done, self._turns / n, self._tool_turns / max(self._turns, 1), self._failures,
                           p.latency_p50_s, p.latency_p99_s, self._wait_slot_s, waiting)
