"""The buffer service: prompts, experience, rewards, the board, and who owns each sample.

One class for both runtimes. The local runtime calls it in-process from its threads; the Ray
runtime wraps the same class with `ray.remote` (a threaded actor: the learner's bounded wait for a
batch must not block the rollout servers' calls) and reaches it through `RemoteBuffer`.

It holds the prompt source, `PromptLedger`, `ExperienceStore`, `Dispatcher` + `WorkQueue` (with
the dispatcher's thread), the `RewardPool` and the authoritative `Board`. Exactly-once lives here
only: every sample taken is recorded with the server that owns it; a dead server's samples are
requeued and its late results dropped; a repack move hands ownership over with the sequence.

A replacement for a dead buffer (Ray runtime) starts from the last checkpoint's snapshot plus the
prompts the learner trained on since (`trained`): those are marked consumed before anything is
dispatched, their rows are forgotten, and the source skips them, so the samples the dead buffer
handed out are regenerated once and nothing is trained twice.
Everything crossing its methods is plain host data (Trajectory records, EvalItems, dicts of numpy
arrays); in-process, rollout workers and the learner get the store's own records (types.Trajectory).
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Optional, Sequence

import numpy as np

from laminar_jax.eval.rounds import EvalItem, EvalSink, eval_share
from laminar_jax.threads import Worker
from laminar_jax.types import REQUIRED_FIELDS, Trajectory, to_row

LATENCY_WINDOW = 4096  # samples whose dispatch-to-completion latency the percentiles cover


class BufferService:
    """Prompts -> work -> experience, plus sample ownership per rollout server (see module doc)."""

    def __init__(self, cfg, learner_version: int, restore: Optional[dict] = None, trained: Sequence[str] = ()):
        from laminar_jax.buffer import ExperienceStore, PromptLedger
        from laminar_jax.data import RewardPool, build_prompt_source
        from laminar_jax.model import load_tokenizer
        from laminar_jax.buffer.dispatch import Dispatcher, WorkQueue
        from laminar_jax.buffer.board import Board
        from laminar_jax.scheduler.modes import default_max_queued_prompts, get_policy

        self.cfg = cfg
        rt = cfg.runtime
        self.policy = get_policy(rt.mode, cfg.scheduler.repack, cfg.scheduler.admit_lag)
        self.tokenizer = load_tokenizer(cfg.model.tokenizer)
        self.source = build_prompt_source(cfg.data, self.tokenizer)
        self.ledger, self.store = PromptLedger(), ExperienceStore(group_size=rt.samples_per_prompt)
        self.queue = WorkQueue()
        self.dispatcher = Dispatcher(self.source, self.ledger, self.store, self.queue, self.policy,
                                     rt.prompts_per_step, rt.samples_per_prompt, cfg.buffer.max_staleness,
                                     cfg.seed, max_queued_prompts=default_max_queued_prompts(rt.prompts_per_step, rt.num_servers),
                                     max_inflight_batches=rt.max_inflight_batches)
        self.trained_skipped = 0  # prompts the source yielded that were trained already (see mark_trained)
        if trained:
            self.source = self.dispatcher.source = _SkipTrained(self.source, set(trained), self._skipped)
            restore = mark_trained(restore or self.dispatcher.snapshot(), trained)
        self.redispatched = self.dispatcher.restore(restore, REQUIRED_FIELDS) if restore else 0
        for uid in trained:  # rows of groups complete at the snapshot and trained since: never again
            self.store.discard_group(uid)
        self.rewards = RewardPool(cfg.data.reward_workers, cfg.data.reward_timeout_s, cfg.data.reward_registry,
                                  mode=cfg.data.reward_mode)
        self.board = Board(rt.num_servers, learner_version)
        self._lock = threading.Lock()  # owners, names, dead, counters
        self._owner: dict[str, tuple[str, Trajectory | EvalItem]] = {}  # sample uid -> (server name, its work)
        self._names = [f"rollout-{i}" for i in range(rt.num_servers)]
        self._dead: set[str] = set()
        self.counters = {"dropped_late_results": 0, "requeued": 0, "moves": 0, "generated_tokens": 0,
                         "zero_signal_groups_filtered": 0, "zero_signal_groups_kept": 0}
        self._filtered_this_batch = 0  # zero-signal groups filtered since the last batch (the refill bound)
        # Dispatch -> completion of the latest accepted samples: stats() (every learner step) takes their
        # percentiles, which over the whole run would cost O(samples so far) per step.
        self._latencies: collections.deque = collections.deque(maxlen=LATENCY_WINDOW)
        self.evals = eval_sink(cfg)  # eval rounds: apart from the store and the ledger
        self._val_prompts: Optional[list] = None  # the held-out prompts, read at the first eval round
        self._stop = threading.Event()
        self._pumper = Worker("buffer-dispatcher", self._dispatch_loop, self._stop).start()

    def _skipped(self) -> None:
        # Called inside Dispatcher.pump (under its lock): the prompt was dispatched once, by the
        # dead buffer, and counts as such for the mode's dispatch allowance.
        self.dispatcher.dispatched += 1
        self.trained_skipped += 1

    def _dispatch_loop(self) -> None:
        while not self._stop.is_set():
            self.dispatcher.pump(self.board.learner_version)
            time.sleep(0.01)

    def check(self) -> None:
        """Re-raise a failure of the dispatcher thread or of a reward worker."""
        self._pumper.check()
        self.rewards.check()

    def ready(self) -> int:
        """Prompts re-dispatched by the restore (the caller's handshake that the service is up)."""
        return self.redispatched

    # ------------------------------------------------------------------------------ the board
    def _alive(self, i: int, name: str) -> bool:
        return name not in self._dead and self._names[i] == name

    def register(self, i: int, name: str, version: int) -> None:
        """A (replacement) rollout server `name` now serves index i."""
        with self._lock:
            self._names[i] = name
            self._dead.discard(name)
            self.board.revive(i, version)

    def report(self, i: int, name: str, version: int, live: int) -> dict:
        """A server's version and live count in; the board as that server should see it out."""
        with self._lock:
            if self._alive(i, name):
                self.board.update(i, version, live)
        return self.board.view(i)

    def set_learner_version(self, version: int) -> None:
        """The learner finished step `version`: servers may take it, dispatch may run ahead."""
        self.check()
        self.board.set_newest(version)
        self.board.set_learner_version(version)
        self.store.evict_consumed(["learner"])

    # ------------------------------------------------------------------------------ work
    def take_work(self, i: int, name: str, version: int, n: int) -> list[Trajectory | EvalItem]:
        """Up to n samples to generate for server `name` (their records, or eval rounds' items), if
        the mode lets it admit now (checked here, on
        the authoritative board: a server's own view may lag a publish by one board sync)."""
        from laminar_jax.scheduler.modes import server_may_admit

        self.check()
        with self._lock:
            if not self._alive(i, name):
                return []  # declared dead: it gets no more work
            self.board.update(i, version, self.board.live[i])
            if not server_may_admit(self.policy, version, self.board.newest, self.board.global_pending()):
                return []
            items = self.evals.take(version, eval_share(n, self.evals.waiting(version), len(self.queue)))
            items += self.queue.take(n - len(items))
            for it in items:
                self._owner[it.uid] = (name, it)
        return items

    def complete(self, name: str, traj: Trajectory) -> bool:
        """A finished trajectory from server `name`: store its fields now, score it off the critical
        path. Dropped (returns False) unless `name` still owns the sample: a dead server's work was
        requeued and is being generated again elsewhere."""
        uid = traj.uid
        with self._lock:
            owner = self._owner.get(uid)
            if owner is None or owner[0] != name or name in self._dead:
                self.counters["dropped_late_results"] += 1
                return False
            del self._owner[uid]
            if isinstance(owner[1], EvalItem):
                self._complete_eval(owner[1], traj)
                return True
            start = self.dispatcher.enqueued_at.pop(uid, None)
            if start is not None:
                self._latencies.append(time.monotonic() - start)
            self.counters["generated_tokens"] += len(traj.response_ids)
        try:
            self.store.put_many(uid, to_row(traj))  # the generated fields, onto the sample's record
            rec = self.store.row(uid)
        except KeyError:  # the row is gone (its prompt was dropped as stale): nothing to fill
            with self._lock:
                self.counters["dropped_late_results"] += 1
            return False
        version = int(traj.version)
        if traj.reward is not None:  # a multi-turn episode, scored by its environment
            self.store.put_many(uid, {"reward": float(traj.reward), "version": version})
            return True
        eos = self.tokenizer.eos_id
        text = self.tokenizer.decode([t for t in np.asarray(traj.response_ids).tolist() if t != eos])
        fut = self.rewards.submit(rec.data_source, text, rec.ground_truth, rec.extra_info)
        # 'version' is written last with the reward, so a row is never ready before it is scored.
        fut.add_done_callback(lambda f: self.store.put_many(uid, {"reward": f.result().reward, "version": version}))
        return True

    def _complete_eval(self, item, traj: Trajectory) -> None:
        """An eval sample: scored by the reward pool, collected by its round (never trained on)."""
        eos = self.tokenizer.eos_id
        text = self.tokenizer.decode([t for t in np.asarray(traj.response_ids).tolist() if t != eos])
        fut = self.rewards.submit(item.data_source, text, item.ground_truth, item.extra_info)
        n, reason, version = len(traj.response_ids), traj.finish_reason, int(traj.version)
        fut.add_done_callback(lambda f: self.evals.add(item, f.result().reward, n, reason, version,
                                                       self.board.learner_version))

    # ------------------------------------------------------------------------------ eval rounds
    def start_eval(self, round_id: int, learner_version: int) -> int:
        """Submit eval round `round_id` at `learner_version` (greedy + runtime.eval_samples sampled
        requests per held-out prompt); returns the number of requests."""
        from laminar_jax.data.source import build_val_prompts
        from laminar_jax.eval.rounds import eval_items

        rt = self.cfg.runtime
        if self._val_prompts is None:
            self._val_prompts = build_val_prompts(self.cfg.data, self.tokenizer, rt.eval_max_prompts)
        items = eval_items(self._val_prompts, round_id, rt.eval_samples, rt.eval_temperature, self.cfg.rollout,
                           self.cfg.seed)
        self.evals.start(round_id, int(learner_version), items)
        return len(items)

    def poll_eval(self) -> dict:
        """{'done': finished round records (each once), 'in_flight': round ids still running}."""
        self.check()
        return {"done": self.evals.pop_done(), "in_flight": self.evals.in_flight()}

    def episode_record(self, uid: str) -> dict:
        """What an environment is chosen and reset with: the sample's data_source, ground_truth, extra_info."""
        return self.store.row(uid).episode_record()

    def server_failed(self, i: int, name: str) -> int:
        """Server `name` died: requeue every sample it owned (regenerated from the prompt, ahead of
        new work); its late results are dropped from now on. Returns the number requeued."""
        with self._lock:
            self._dead.add(name)
            if self._names[i] == name:
                self.board.retire(i)
            items = [it for uid, (owner, it) in self._owner.items() if owner == name]
            for it in items:
                del self._owner[it.uid]
            self.counters["requeued"] += len(items)
        self.evals.requeue([it for it in items if isinstance(it, EvalItem)])
        self.dispatcher.requeue([it for it in items if not isinstance(it, EvalItem)])
        return len(items)

    def move(self, uid: str, src: str, dst: str) -> bool:
        """Repack moved (or is moving) sample `uid` from src to dst; False if src no longer owns it."""
        with self._lock:
            owner = self._owner.get(uid)
            if owner is None or owner[0] != src or dst in self._dead:
                return False
            self._owner[uid] = (dst, owner[1])
            self.counters["moves"] += 1
            return True

    def requeue_uid(self, uid: str, owner: str) -> bool:
        """A moved sequence was lost on both sides of a failed move: generate it again."""
        with self._lock:
            entry = self._owner.get(uid)
            if entry is None or entry[0] != owner:
                return False
            del self._owner[uid]
            self.counters["requeued"] += 1
        if isinstance(entry[1], EvalItem):
            self.evals.requeue([entry[1]])
        else:
            self.dispatcher.requeue([entry[1]])
        return True

    # ------------------------------------------------------------------------------ learner
    def get_batch(self, n_groups: int, learner_version: int, timeout: float) -> Optional[dict]:
        """Wait up to `timeout` s for n complete groups; mark their prompts consumed in the ledger.

        Returns {"rows": [the members' Trajectory records], "duplicates": k} or None on timeout.
        Groups over the staleness
        bound (buffer.max_staleness) are dropped or skipped as buffer.on_stale says.
        """
        from laminar_jax.buffer import BufferTimeout, DuplicatePrompt, select_fifo, select_with_signal, zero_signal

        self.check()
        b = self.cfg.buffer
        dropped: list = []
        filtered: list = []  # zero-signal groups (learner.dynamic_sampling)
        taken: list = []
        # The refill bound spans every call that fills one batch (a call may time out before it is full).
        budget = self.cfg.learner.dynamic_sampling_max_retries * n_groups - self._filtered_this_batch

        def select(groups, n):
            if self.cfg.learner.dynamic_sampling:
                sel = select_with_signal(groups, n, learner_version, budget - len(filtered), b.max_staleness,
                                         b.on_stale)
            else:
                sel = select_fifo(groups, n, learner_version, b.max_staleness, b.on_stale)
            dropped.extend(sel.drop)
            filtered.extend(sel.filtered)
            taken[:] = sel.take
            return sel

        try:
            rows = self.store.get("learner", n_groups, REQUIRED_FIELDS, timeout=timeout, select=select)
        except BufferTimeout:
            rows = None
        for g in dropped:
            self.ledger.drop(g.group)
            self.dispatcher.release(g.group)
        for g in filtered:
            self.ledger.filter(g.group)
            self.dispatcher.release(g.group)
        with self._lock:
            self._filtered_this_batch += len(filtered)
            self.counters["zero_signal_groups_filtered"] += len(filtered)  # by this service (the ledger's: the run's)
            if rows is not None:
                self._filtered_this_batch = 0
                if self.cfg.learner.dynamic_sampling:  # taken past the refill bound
                    self.counters["zero_signal_groups_kept"] += sum(map(zero_signal, taken))
        if rows is None:
            return None
        duplicates = 0
        for uid in sorted({r.prompt_uid for r in rows}):
            try:
                self.ledger.consume(uid)
            except DuplicatePrompt:
                duplicates += 1
        return {"rows": rows, "duplicates": duplicates}

    def snapshot(self) -> dict:
        """The dispatcher's consistent snapshot (source position, ledger, store) for a checkpoint."""
        return self.dispatcher.snapshot()

    def stats(self) -> dict:
        """Counters for the monitor and the final summary (plain data)."""
        groups = self.store.groups()
        in_flight = self.ledger.in_flight()
        with self._lock:
            owned: dict[str, int] = {}
            for name, _ in self._owner.values():
                owned[name] = owned.get(name, 0) + 1
            # over the latest LATENCY_WINDOW samples
            lat = np.percentile(self._latencies, [50, 99]).tolist() if self._latencies else [None, None]
            counters = dict(self.counters)
        return {"queue": len(self.queue), "ledger": self.ledger.summary(),
                "lost_prompts": sum(1 for uid, _ in in_flight if uid not in groups),
                "ready_groups": self.store.ready_groups("learner", REQUIRED_FIELDS), "owned": owned,
                "redispatched": self.redispatched, "trained_skipped": self.trained_skipped,
                "board_versions": list(self.board.versions),
                "board_live": list(self.board.live), "newest": self.board.newest,
                "latency_p50_s": lat[0], "latency_p99_s": lat[1], "reward_failures": self.rewards.failures,
                "eval_tokens": self.evals.tokens,
                **counters}

    def close(self) -> None:
        self._stop.set()
        self._pumper.join(timeout=10)
        self.rewards.close()


def eval_sink(cfg) -> EvalSink:
    """The sink of this run's eval rounds (pass@k only with sampled responses)."""
    rt = cfg.runtime
    return EvalSink(rt.eval_k if rt.eval_samples else None, rt.eval_correct_threshold)


def mark_trained(state: dict, trained: Sequence[str]) -> dict:
    """A dispatcher snapshot with `trained` prompts marked consumed in its ledger (pure: a new dict).
    Prompts the snapshot does not know (dispatched after it) get a consumed entry of their own, so a
    dispatch of theirs would be refused as a duplicate instead of training them twice."""
    ledger = state["ledger"]
    entries = {u: dict(e) for u, e in ledger["entries"].items()}
    counters = dict(ledger["counters"])
    for uid in trained:
        e = entries.get(uid)
        if e is None:
            entries[uid] = {"prompt": {"uid": uid}, "state": "consumed", "dispatches": 1}
            counters["dispatched"] = counters.get("dispatched", 0) + 1
        elif e["state"] != "dispatched":
            continue  # consumed or dropped at the snapshot already
        else:
            e["state"] = "consumed"
        counters["consumed"] = counters.get("consumed", 0) + 1
    return {**state, "ledger": {**ledger, "entries": entries, "counters": counters}}


class _SkipTrained:
    """The prompt source without the prompts in `trained` (drawn again after a restore to an older
    position); `on_skip()` is called for each one skipped. Checkpoint state is the source's own."""

    def __init__(self, source, trained: set, on_skip):
        self.source, self.trained, self.on_skip = source, trained, on_skip

    def __iter__(self):
        return self

    def __next__(self):
        while True:
            prompt = next(self.source)
            if prompt.uid not in self.trained:
                return prompt
            self.on_skip()

    def get_state(self):
        return self.source.get_state()

    def set_state(self, state) -> None:
        self.source.set_state(state)

    def __getattr__(self, name: str):
        return getattr(self.source, name)
