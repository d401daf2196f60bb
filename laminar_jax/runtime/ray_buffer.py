"""The driver's view of the buffer actor, restarted when it dies (Ray runtime).

The buffer actor holds the ledger: which prompts were dispatched, generated, consumed. When it
dies (a `RayActorError` from any call) the driver starts a replacement under the same Ray name
from the buffer state of the last checkpoint plus the prompts trained since, which the driver
knows: every batch it trained came back from `get_batch`, and every checkpoint's buffer state came
from `snapshot()`. Both are read here as they pass, so the Driver is unchanged.

The replacement marks those prompts consumed before it dispatches anything (BufferService's
`trained`), re-dispatches the prompts that were in flight, and knows nothing of the samples the
dead buffer handed out: rollout actors finishing them find the replacement by name
(`RemoteBuffer`), and their results are dropped as unowned; the samples are generated again.
A batch the dead buffer returned while the replacement was being built (it could not know of it)
is given up as a timeout: the replacement generates those prompts again, and they are trained once.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Optional

from laminar_jax.runtime.ray_actors import RemoteBuffer

log = logging.getLogger(__name__)


class RestartingBuffer(RemoteBuffer):
    """`RemoteBuffer` that replaces a dead buffer actor (see the module docstring).

    spawn(learner_version, restore, trained) -> (handle, redispatched): a new, ready buffer actor.
    on_restart: called with (new handle, this proxy) once the replacement serves.
    """

    def __init__(self, handle, timeout_s: float, spawn: Callable, learner_version: int, restore: Optional[dict],
                 max_restarts: int, on_restart: Optional[Callable] = None, t0: Optional[float] = None):
        super().__init__(handle, timeout_s)
        self._spawn, self._max_restarts, self.on_restart = spawn, max_restarts, on_restart
        self._lock = threading.RLock()
        self._restore = restore  # buffer state of the last checkpoint (None: the run's start)
        self._trained: list[str] = []  # prompts trained since that state, in order
        self._version = learner_version
        self._t0 = time.time() if t0 is None else t0
        self.restarts: list[dict] = []  # failure records (the Driver's failure list takes them too)
        self.failures: Optional[list] = None
        self._last_answer = time.monotonic()

    def keep_alive(self, idle_s: float = 1.0) -> None:
        """Call the buffer if nothing has for `idle_s` (the health loop does, every poll): a dead
        buffer is replaced even while the learner is busy with a long step, so rollout actors
        waiting for the replacement are not left waiting."""
        if time.monotonic() - self._last_answer > idle_s:
            self.ready()

    def _replacement(self, dead, method: str, error: BaseException):
        if method == "close":
            return None  # nothing left to close
        self._restart(dead, error)
        return self.handle

    def _note(self, handle, method: str, args: tuple, out):
        """Keep what a restart needs from the answers passing by; give up a batch from a buffer that
        was replaced meanwhile (the replacement does not know it was consumed)."""
        with self._lock:
            current = handle is self.handle
            self._last_answer = time.monotonic()
            if method == "get_batch" and out is not None:
                if not current:
                    log.warning("dropped a batch from the buffer actor that was replaced meanwhile; "
                                "its prompts are generated again")
                    return None
                self._trained.extend(sorted({r.prompt_uid for r in out["rows"]}))
            elif method == "snapshot" and current:
                self._restore, self._trained = out, []
            elif method == "set_learner_version":
                self._version = max(self._version, int(args[0]))
        return out

    def _restart(self, dead, error: BaseException) -> None:
        """Replace `dead` (once: a caller that finds it replaced already just retries)."""
        import ray

        with self._lock:
            if dead is not self.handle:
                return
            if len(self.restarts) >= self._max_restarts:
                raise RuntimeError(f"the buffer actor died more than scheduler.max_server_restarts="
                                   f"{self._max_restarts} times; last: {error!r}") from error
            t_fail = time.time()
            log.warning("buffer actor died (%r); restarting it from the last checkpoint's buffer state "
                        "and %d prompts trained since", error, len(self._trained))
            try:
                ray.kill(dead, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
            handle, redispatched = self._spawn(self._version, self._restore, list(self._trained))
            self.handle = handle
            record = {"buffer": repr(error), "t": round(t_fail - self._t0, 2), "redispatched": redispatched,
                      "trained_since_checkpoint": len(self._trained)}
            if self.on_restart is not None:
                self.on_restart(handle, self)
            record["recovery_s"] = round(time.time() - t_fail, 3)
            self.restarts.append(record)
            if self.failures is not None:
                self.failures.append(record)
