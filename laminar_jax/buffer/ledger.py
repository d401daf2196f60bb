"""Prompt ledger: every dispatched prompt is tracked until its trajectories are consumed.

States: dispatched -> consumed (or dropped, which also ends it). A prompt that is dispatched but
not consumed when the run stops is *in flight*; on resume it is dispatched again (its old partial
samples were never consumed, so nothing is repeated). Exactly-once per epoch: a uid already
consumed is refused.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Optional


@dataclasses.dataclass
class _Entry:
    prompt: dict  # JSON-serialisable prompt record, enough to dispatch it again
    state: str  # 'dispatched' | 'consumed' | 'dropped'
    dispatches: int = 1


class DuplicatePrompt(RuntimeError):
    pass


class PromptLedger:
    def __init__(self):
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}
        self.counters = {"dispatched": 0, "redispatched": 0, "consumed": 0, "dropped": 0,
                         "duplicate_consumes": 0}

    def dispatch(self, uid: str, prompt: dict) -> None:
        with self._lock:
            e = self._entries.get(uid)
            if e is not None and e.state != "dispatched":
                raise DuplicatePrompt(f"prompt {uid!r} already {e.state}; refusing to dispatch it again")
            if e is None:
                self._entries[uid] = _Entry(prompt=prompt, state="dispatched")
                self.counters["dispatched"] += 1
            else:
                e.dispatches += 1
                self.counters["redispatched"] += 1

    def consume(self, uid: str) -> None:
        self._finish(uid, "consumed")

    def drop(self, uid: str) -> None:
        self._finish(uid, "dropped")

    def _finish(self, uid: str, state: str) -> None:
        with self._lock:
            e = self._entries.get(uid)
            if e is None:
                raise KeyError(f"prompt ledger: {uid!r} was never dispatched")
            if e.state != "dispatched":
                self.counters["duplicate_consumes"] += 1
                raise DuplicatePrompt(f"prompt {uid!r} already {e.state}")
            e.state = state
            self.counters[state] += 1

    def in_flight(self) -> list[tuple[str, dict]]:
        with self._lock:
            return [(u, e.prompt) for u, e in self._entries.items() if e.state == "dispatched"]

    def state_of(self, uid: str) -> Optional[str]:
        with self._lock:
            e = self._entries.get(uid)
            return None if e is None else e.state

    def summary(self) -> dict[str, int]:
        with self._lock:
            states = [e.state for e in self._entries.values()]
            return {"total": len(states), "in_flight": states.count("dispatched"),
                    "consumed": states.count("consumed"), "dropped": states.count("dropped"),
                    "duplicated": self.counters["duplicate_consumes"]}

    def state_dict(self) -> dict[str, Any]:
        with self._lock:
            return {"entries": {u: dataclasses.asdict(e) for u, e in self._entries.items()},
                    "counters": dict(self.counters)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with self._lock:
            self._entries = {u: _Entry(**e) for u, e in state["entries"].items()}
            self.counters.update(state["counters"])
