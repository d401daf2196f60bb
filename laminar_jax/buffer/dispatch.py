"""Dispatcher: prompts -> ledger + one record per sample (in the store) + the shared work queue, as
the mode allows.

Rollout workers take work from the queue when *they* are ready (Laminar's pull model). The
dispatcher's lock makes checkpoints consistent: the source's position, the ledger and the store
are snapshotted together, so every prompt drawn from the source is in the ledger.
"""

from __future__ import annotations

import collections
import hashlib
import threading
import time
from typing import Optional

import numpy as np

from laminar_jax.buffer import ExperienceStore, PromptLedger
from laminar_jax.scheduler.modes import ModePolicy, dispatch_allowance, queue_room
from laminar_jax.types import PROMPT_FIELDS, Trajectory


class WorkQueue:
    """FIFO of samples to generate (their records) shared by all rollout workers (thread-safe,
    bounded waits)."""

    def __init__(self):
        self._cv = threading.Condition()
        self._q: collections.deque[Trajectory] = collections.deque()

    def put_many(self, items, front: bool = False) -> None:
        with self._cv:
            if front:
                self._q.extendleft(reversed(list(items)))
            else:
                self._q.extend(items)
            self._cv.notify_all()

    def take(self, n: int, timeout: float = 0.0) -> list[Trajectory]:
        deadline = time.monotonic() + timeout
        with self._cv:
            while not self._q and timeout > 0:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cv.wait(left)
            out = []
            while self._q and len(out) < n:
                out.append(self._q.popleft())
            return out

    def __len__(self) -> int:
        with self._cv:
            return len(self._q)


def _sample_seed(base_seed: int, prompt_uid: str, sample_index: int) -> int:
    # Stable across processes and resumes (Python's hash() is randomised per process).
    digest = hashlib.blake2b(f"{base_seed}:{prompt_uid}:{sample_index}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF


class Dispatcher:
    def __init__(self, source, ledger: PromptLedger, store: ExperienceStore, queue: WorkQueue,
                 policy: ModePolicy, prompts_per_step: int, samples_per_prompt: int,
                 max_staleness: Optional[int], seed: int, max_queued_prompts: int,
                 max_inflight_batches: Optional[int] = None):
        self.source, self.ledger, self.store, self.queue = source, ledger, store, queue
        self.policy = policy
        self.prompts_per_step = prompts_per_step
        self.samples_per_prompt = samples_per_prompt
        self.max_staleness = max_staleness
        self.seed = seed
        self.max_queued_prompts = max_queued_prompts
        self.max_inflight_batches = max_inflight_batches
        self.lock = threading.RLock()
        self.dispatched = 0  # prompts ever dispatched (new ones, not re-dispatches)
        self.enqueued_at: dict[str, float] = {}  # sample uid -> monotonic time of its first dispatch
        self.exhausted = False

    def pump(self, learner_version: int) -> int:
        """Dispatch as many new prompts as the mode and the queue's capacity allow."""
        with self.lock:
            # Dropped (over-stale) and filtered (zero-signal) prompts free their place: never trained on.
            effective = self.dispatched - self.ledger.untrained()
            allowance = dispatch_allowance(self.policy, learner_version, effective,
                                           self.prompts_per_step, self.max_staleness,
                                           self.max_inflight_batches)
            room = queue_room(self.max_queued_prompts, len(self.queue), self.samples_per_prompt)
            n = room if allowance is None else min(room, allowance)
            count = 0
            while count < n and not self.exhausted:
                try:
                    prompt = next(self.source)
                except StopIteration:
                    self.exhausted = True
                    break
                record = _prompt_record(prompt)
                self.ledger.dispatch(prompt.uid, record)
                self._enqueue(record)
                self.dispatched += 1
                count += 1
            return count

    def _enqueue(self, record: dict, samples: Optional[list[int]] = None, front: bool = False) -> None:
        items = []
        prompt_ids = np.asarray(record["prompt_ids"], np.int32)
        for i in samples if samples is not None else range(self.samples_per_prompt):
            sample = Trajectory(uid=f"{record['uid']}/{i}", prompt_uid=record["uid"], sample_index=i,
                                prompt_ids=prompt_ids, seed=_sample_seed(self.seed, record["uid"], i),
                                data_source=record["data_source"], ground_truth=record["ground_truth"],
                                extra_info=record["extra_info"])
            items.append(self.store.add(sample, PROMPT_FIELDS))  # the record held (one already, on a re-dispatch)
        now = time.monotonic()
        for it in items:  # first dispatch only: a requeued sample keeps its original start
            self.enqueued_at.setdefault(it.uid, now)
        self.queue.put_many(items, front=front)

    def release(self, prompt_uid: str) -> None:
        """Forget the dispatch times of a prompt's samples (its group was dropped as stale)."""
        for i in range(self.samples_per_prompt):
            self.enqueued_at.pop(f"{prompt_uid}/{i}", None)

    def requeue(self, items: list[Trajectory]) -> None:
        """Give work back (a dead server's sequences): regenerated from the prompt, ahead of new work."""
        self.queue.put_many(items, front=True)

    # ---- checkpoint -----------------------------------------------------------------------
    def snapshot(self) -> dict:
        with self.lock:
            return {"source": self.source.get_state(), "ledger": self.ledger.state_dict(),
                    "store": self.store.state_dict(), "dispatched": self.dispatched}

    def restore(self, state: dict, required_fields: tuple[str, ...]) -> int:
        """Restore a snapshot; re-dispatch every in-flight prompt whose group is not complete.

        Returns the number of prompts re-dispatched. Complete, unconsumed groups stay in the store
        and are trained on first; partial groups are regenerated (their rows rewritten in place).
        """
        with self.lock:
            self.source.set_state(state["source"])
            self.ledger.load_state_dict(state["ledger"])
            self.store.load_state_dict(state["store"])
            self.dispatched = int(state["dispatched"])
            redo = 0
            for uid, record in self.ledger.in_flight():
                missing = self.store.samples_missing(uid, required_fields, self.samples_per_prompt)
                if not missing:
                    continue  # complete: trained on first
                self.ledger.dispatch(uid, record)  # counted as a re-dispatch
                self._enqueue(record, samples=missing, front=True)
                redo += 1
            return redo


def _prompt_record(prompt) -> dict:
    """JSON-serialisable prompt record kept in the ledger (enough to dispatch it again)."""
    return {"uid": prompt.uid, "prompt_ids": [int(t) for t in prompt.prompt_ids],
            "data_source": prompt.data_source, "ground_truth": prompt.ground_truth,
            "extra_info": prompt.extra_info}
