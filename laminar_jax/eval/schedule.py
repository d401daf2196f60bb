"""When a run evaluates, and what it does with a finished round (the Driver's side).

Rounds are due at learner versions that are multiples of runtime.eval_every, at the last step, and
before the first step with runtime.eval_before_train. At most one round is in flight: a round due
while another runs starts at the first step after that one is collected (its record says the
version it really ran at). In 'sync' mode the learner waits for each round (as verl does); in the
other modes it trains on while the round's requests share the rollout servers' slots, and
finished rounds are collected after each step.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Optional

log = logging.getLogger(__name__)


def is_due(version: int, every: int, total_steps: int) -> bool:
    """Whether learner version `version` (> 0) is an eval point: every `every` steps, and the last."""
    return every > 0 and version > 0 and (version % every == 0 or version == total_steps)


class Evaluation:
    """buffer: the buffer service (start_eval / poll_eval, in-process or a Ray actor's proxy);
    on_round: called with each finished round record (the monitor writes it)."""

    def __init__(self, rt, buffer, on_round: Callable[[dict], None]):
        self.rt, self.buffer, self.on_round = rt, buffer, on_round
        self.blocking = rt.mode == "sync"
        self.rounds = 0  # rounds started
        self.pending_since: Optional[int] = None  # a round was due at this version but one was in flight
        self.in_flight: list[int] = []
        self.done: list[dict] = []

    @classmethod
    def maybe(cls, cfg, buffer, on_round) -> Optional["Evaluation"]:
        rt = cfg.runtime
        return cls(rt, buffer, on_round) if rt.eval_every or rt.eval_before_train else None

    def begin(self, version: int) -> None:
        if self.rt.eval_before_train:
            self._start(version)

    def after_step(self, version: int) -> None:
        self.collect()
        if is_due(version, self.rt.eval_every, self.rt.total_steps) or self.pending_since is not None:
            if self.in_flight:
                self.pending_since = self.pending_since if self.pending_since is not None else version
                return
            self.pending_since = None
            self._start(version)

    def finish(self, version: int, timeout_s: float, stop=None) -> None:
        """The run ended at `version`: wait (bounded) for the round in flight, start the round still
        owed (the last step's, deferred behind it), and wait for that one too."""
        self.wait(timeout_s, stop)
        if not self.in_flight and self.pending_since is not None and not (stop is not None and stop.is_set()):
            self.pending_since = None
            self._start(version, block=False)
            self.wait(timeout_s, stop)
        if self.in_flight:
            log.warning("eval rounds %s did not finish within runtime.wait_timeout_s=%ss; not recorded",
                        self.in_flight, timeout_s)

    def _start(self, version: int, block: Optional[bool] = None) -> None:
        n = self.buffer.start_eval(self.rounds, version)
        log.info("eval round %d submitted at learner version %d (%d requests)", self.rounds, version, n)
        self.in_flight.append(self.rounds)
        self.rounds += 1
        if self.blocking if block is None else block:
            self.wait(self.rt.wait_timeout_s, raise_on_timeout=True)

    def collect(self) -> list[dict]:
        out = self.buffer.poll_eval()
        finished = {rec["round"] for rec in out["done"]}
        lost = [r for r in self.in_flight if r not in out["in_flight"] and r not in finished]
        if lost:  # a replacement buffer actor (Ray) knows nothing of the dead one's rounds
            log.warning("eval rounds %s were lost with the buffer service that held them; not recorded", lost)
        self.in_flight = list(out["in_flight"])
        for rec in out["done"]:
            self.done.append(rec)
            self.on_round(rec)
        return out["done"]

    def wait(self, timeout_s: float, stop=None, raise_on_timeout: bool = False) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            self.collect()
            if not self.in_flight or (stop is not None and stop.is_set()):
                return
            if time.monotonic() > deadline:
                if raise_on_timeout:
                    raise TimeoutError(f"eval rounds {self.in_flight} did not finish within "
                                       f"runtime.wait_timeout_s={timeout_s}s")
                return
            time.sleep(0.05)
