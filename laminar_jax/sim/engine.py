"""Discrete-event cluster simulator of RL post-training, driven by the project's own policies.

Time advances in ticks of ``tick_s`` for the rollout servers, which move many decode steps per tick
(step time from the roofline cost model at the server's batch and context); sequence completions
inside a tick get their exact interpolated times. The learner, publishes and relay arrivals run in
continuous time. Every decision the runtime makes is the runtime's own function, looked up on its
module at call time (so a monkeypatched policy changes the simulation):

  dispatch gate    laminar_jax.scheduler.modes.dispatch_allowance
  admission        laminar_jax.scheduler.modes.server_may_admit
  weight swap      laminar_jax.scheduler.modes.swap_now
  repack           laminar_jax.scheduler.repack.plan_repack on ServerView snapshots
  batch selection  laminar_jax.buffer.policies.select_fifo (+ policies.staleness)

``partial_rollout`` is the one mode the runtime does not have; its policy is laminar_jax.sim.partial.

State layout: slot arrays ``[servers, max_num_seqs]`` (sequence id, remaining tokens, context, ...),
per-server vectors (version, load/prefill busy-until), and per-sequence/per-group tables grown as
prompts are dispatched. Sequence ids are prompt-major: sid = prompt · samples_per_prompt + j.

The Simulator holds that state and makes the runtime's decisions (weights, dispatch, admission,
repack); the mechanics live beside it: kv.py (KV pages, preemption, moves), decode.py (decode
ticks, turn ends, completed groups), learner.py (the learner's steps and publishes).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from laminar_jax.buffer import policies
from laminar_jax.scheduler import modes, repack
from laminar_jax.sim import decode, kv, partial
from laminar_jax.sim.config import SimSection
from laminar_jax.sim.cost import CostModel
from laminar_jax.sim.learner import SimLearner
from laminar_jax.sim.metrics import Recorder, SimResult
from laminar_jax.sim.workload import WorkloadSpec, sample


@dataclasses.dataclass(frozen=True)
class Placement:
    """Resolved GPU split.

    Attributes:
      learner_gpus: GPUs of the learner.
      tp: GPUs per rollout server.
      servers: Number of rollout servers.
    """

    learner_gpus: int
    tp: int
    servers: int


class _Table:
    """Growable per-sequence / per-group columns (numpy arrays, doubled when full)."""

    def __init__(self, **dtypes_fill):
        self.n = 0
        self._fill = dtypes_fill
        self.cols = {k: np.full(1024, f, dtype=d) for k, (d, f) in dtypes_fill.items()}

    def grow_to(self, n: int) -> None:
        cap = len(next(iter(self.cols.values())))
        if n > cap:
            new = max(n, 2 * cap)
            for k, (d, f) in self._fill.items():
                col = np.full(new, f, dtype=d)
                col[:cap] = self.cols[k]
                self.cols[k] = col
        self.n = max(self.n, n)

    def __getitem__(self, k: str) -> np.ndarray:
        return self.cols[k]


def snapshot_servers(live: np.ndarray, version: np.ndarray, eligible: np.ndarray, max_batch: int) -> np.ndarray:
    """Ids of the servers worth showing plan_repack; the plan is the same as with every server.

    Left out: servers with live >= max_batch (never a source, since a source has live < B; never a
    destination, since live_after would exceed B), and, per version, the empty servers beyond the
    first k, k = that version's non-empty candidates (an upper bound on its sources). Empty servers
    of one version are interchangeable destinations and plan_repack breaks ties by list order, so
    it never reaches past the first k. Loading servers (ineligible) run no version yet. Keeps the
    O(|S|^2) planner cheap at 1024 GPUs; tests/sim check the equivalence on random states.
    """
    cand = eligible & (live < max_batch)
    keep = cand & (live > 0)
    for v in np.unique(version[cand & (live == 0)]):
        k = int((keep & (version == v)).sum())
        empties = np.nonzero(cand & (live == 0) & (version == v))[0][:k]
        keep[empties] = True
    return np.nonzero(keep)[0]


class Simulator:
    """One simulated run of ``cfg`` under ``cost``; call :meth:`run` once."""

    def __init__(self, cfg: SimSection, cost: CostModel, work: WorkloadSpec, place: Placement):
        self.cfg, self.cost, self.work, self.place = cfg, cost, work, place
        self.rng = np.random.default_rng(cfg.seed)
        self.k = cfg.samples_per_prompt
        self.B = cfg.steps_prompts()
        self.partial = cfg.mode == partial.NAME
        self.inflight = cfg.mode == "inflight"
        self.policy = partial.policy() if self.partial else modes.get_policy(cfg.mode, cfg.repack, cfg.admit_lag)
        S, M = place.servers, cfg.max_num_seqs
        self.S, self.M = S, M
        self.kv_cap = cost.kv_pages()
        if self.kv_cap * cfg.page_tokens < work.max_prompt + work.max_response:
            raise ValueError(f"sim: a {cost.model.name} server of tp={cost.tp} holds {self.kv_cap} KV pages, "
                             f"less than one longest sequence; raise sim.rollout_tp")
        # Slots.
        self.sid = np.full((S, M), -1, np.int64)
        self.rem = np.zeros((S, M))  # tokens left in the current turn
        self.left = np.zeros((S, M))  # tokens left after the current turn
        self.ctx = np.zeros((S, M))  # KV tokens held (or to re-prefill when paused)
        self.ready_t = np.zeros((S, M))  # decodable from (env wait, KV transfer)
        self.paused = np.zeros((S, M), bool)  # preempted: holds no KV, resumes with a re-prefill
        self.adm = np.zeros((S, M))  # admission time (preemption order)
        # Flat views of the slot arrays (the hot loop works on the occupied slots only) and a zeroed
        # [S·M] scratch row: per-server float sums go through it so that they add the same numbers
        # in the same order as a sum over the whole [S, M] array (identical results).
        self._flat = {k: getattr(self, k).reshape(-1) for k in ("sid", "rem", "ctx", "ready_t", "paused")}
        self._scratch = np.zeros(S * M)
        # Servers.
        self.version = np.zeros(S, np.int64)
        self.loading = np.zeros(S, bool)
        self.load_target = np.zeros(S, np.int64)
        self.busy_until = np.zeros(S)  # load or prefill work ends
        self.used_prev = np.zeros(S, np.int64)
        self.used = np.zeros(S)  # KV pages held per server, as of the last _preempt (+ resumes)
        self.hop = (np.arange(S) * place.tp) // cost.gpu.gpus_per_node
        # Sequences and groups.
        self.seqs = _Table(plen=(np.int64, 0), rlen=(np.int64, 0), turns=(np.int64, 1), ver=(np.int64, 0),
                           t_adm=(np.float64, -1.0), t_fin=(np.float64, -1.0), vtok=(np.float64, 0.0))
        self.groups = _Table(done=(np.int64, 0), ready=(np.float64, 0.0), ver=(np.int64, 1 << 62),
                             tok=(np.int64, 0), vtok=(np.float64, 0.0), rtok=(np.float64, 0.0))
        self.queue = np.zeros(1024, np.int64)
        self.q_head = self.q_tail = 0
        self.dispatched = 0
        self.consumed = 0  # prompts consumed or dropped by the learner
        self.buf: list[tuple[float, policies.GroupMeta]] = []  # complete groups, FIFO
        self.group_seq = 0
        self.learner = SimLearner(self)
        self.v_seen = 0  # newest version the rollout side has seen
        self.next_repack = 0.0
        self.rec = Recorder(cfg, place, self.kv_cap)
        self.load_s = cost.weight_load_s()
        self.d2h_s = cost.publish_d2h_s(place.learner_gpus)
        self.max_st = {"stream": cfg.max_staleness, partial.NAME: cfg.max_staleness,
                       "laminar": cfg.laminar_max_staleness, "inflight": cfg.laminar_max_staleness}.get(cfg.mode)
        self.max_queued = (cfg.max_queued_prompts if cfg.max_queued_prompts is not None
                           else modes.default_max_queued_prompts(self.B, S))

    # ------------------------------------------------------------------------------------------
    def run(self) -> SimResult:
        cfg, t = self.cfg, 0.0
        while True:
            self._tick(t)
            t += cfg.tick_s
            if t >= cfg.max_duration_s:
                break
            if t >= cfg.duration_s and self.rec.steps_after_warmup() >= cfg.min_steps:
                break
        return self.rec.result(t, self)

    def _tick(self, t: float) -> None:
        t1 = t + self.cfg.tick_s
        new_version = self._see_publishes(t)
        self._finish_loads(t)
        self._swaps(t)
        self._dispatch()
        kv.resume_paused(self, t)
        self._admit(t)
        if self.policy.repack and (t >= self.next_repack or new_version):
            self._repack(t)
            self.next_repack = t + self.cfg.repack_interval_s
        decode.decode(self, t, t1)
        kv.preempt(self)
        self.learner.advance(t, t1)
        self.rec.sample_tick(t, t1, self)

    # ---- weights ----------------------------------------------------------------------------
    def _see_publishes(self, t: float) -> bool:
        v = self.v_seen
        while v + 1 < len(self.learner.publish_t) and self.learner.publish_t[v + 1] <= t:
            v += 1
            self.rec.publish(self.learner.publish_t[v], v)
        changed, self.v_seen = v != self.v_seen, v
        return changed

    def _finish_loads(self, t: float) -> None:
        done = self.loading & (self.busy_until <= t)
        self.version[done] = self.load_target[done]
        self.loading[done] = False

    def _start_load(self, servers: np.ndarray, t: float) -> None:
        """Pull the newest version from the local relay: wait for the chain, then PCIe."""
        if servers.size == 0:
            return
        v = self.v_seen
        if self.cfg.colocate:  # the weights are already on these GPUs: only the reload
            arrive = np.full(servers.size, self.learner.publish_t[v])
        else:
            arrive = self.learner.publish_t[v] + np.array([self.cost.relay_arrival_s(int(h)) for h in self.hop[servers]])
        start = np.maximum(t, arrive)
        self.busy_until[servers] = start + self.load_s
        self.loading[servers] = True
        self.load_target[servers] = v
        self.rec.pulls(self.busy_until[servers] - t)

    def _swaps(self, t: float) -> None:
        newest = self.v_seen
        want = (~self.loading) & (self.version < newest)
        if not want.any():
            return
        live = (self.sid >= 0).sum(1)
        if self.inflight:  # as the runtime's swap_now: at once, live sequences and all
            idx = np.nonzero(want)[0]
            self._start_load(idx, t)
            if idx.size and self.cfg.inflight_kv == "reprefill":
                self._reprefill(idx)
            return
        if self.partial:
            idx = [s for s in np.nonzero(want)[0]
                   if partial.interrupt_now(int(self.version[s]), newest, bool(self.loading[s]))]
            idx = np.asarray(idx, np.int64)
            self._start_load(idx, t)
            if idx.size:
                self._reprefill(idx)
            return
        live_list = sorted(live.tolist(), reverse=True)  # swap_now's all(): nonzero first
        go = [s for s in np.nonzero(want & (live == 0))[0]
              if modes.swap_now(self.policy, 0, live_list)]
        self._start_load(np.asarray(go, np.int64), t)

    def _reprefill(self, idx: np.ndarray) -> None:
        """Re-prefill every kept sequence of servers ``idx`` under the new weights, after the load."""
        held = np.where(self.sid[idx] >= 0, self.ctx[idx], 0.0)
        self.busy_until[idx] += self.cost.prefill_s(held.sum(1), (held ** 2).sum(1))
        self.rec.reprefill_tokens += float(held.sum())

    def _global_pending(self) -> bool:
        return bool((self.version < self.v_seen).any())

    # ---- prompts ----------------------------------------------------------------------------
    def _dispatch(self) -> None:
        # As the runtime's Dispatcher.pump: dropped (over-stale) prompts free their place.
        effective = self.dispatched - self.rec.dropped
        if self.partial:
            allow = partial.dispatch_allowance(self.v_seen, effective, self.B, self.max_st)
        else:
            allow = modes.dispatch_allowance(self.policy, self.v_seen, effective, self.B, self.max_st,
                                             self.cfg.max_inflight_batches)
        # The runtime's work-queue bound (prompts not yet admitted by a server).
        room = modes.queue_room(self.max_queued, self.q_tail - self.q_head, self.k)
        # Capacity: prompts outstanding (dispatched, not yet consumed) never exceed what the slots
        # can hold plus max_buffered_steps batches waiting in the buffer.
        cap = math.ceil(self.S * self.M / self.k) + math.ceil(self.cfg.max_buffered_steps * self.B)
        room = min(room, cap - (self.dispatched - self.consumed))
        if len(self.buf) >= self.cfg.max_buffered_steps * self.B:
            room = 0  # the learner is behind: stop feeding the buffer
        n = room if allow is None else min(room, allow)
        if n <= 0:
            return
        p0 = self.dispatched
        draws = sample(self.work, n, self.k, self.rng)
        s0, s1 = p0 * self.k, (p0 + n) * self.k
        self.seqs.grow_to(s1)
        self.groups.grow_to(p0 + n)
        self.seqs["plen"][s0:s1], self.seqs["rlen"][s0:s1] = draws.prompt_len, draws.response_len
        self.seqs["turns"][s0:s1] = draws.turns
        self._enqueue(np.arange(s0, s1))
        self.dispatched += n

    def _enqueue(self, sids: np.ndarray) -> None:
        n = sids.size
        live = self.q_tail - self.q_head
        if self.q_tail + n > self.queue.size:
            new = np.zeros(max(2 * self.queue.size, live + n + 1024), np.int64)
            new[:live] = self.queue[self.q_head:self.q_tail]
            self.queue, self.q_head, self.q_tail = new, 0, live
        self.queue[self.q_tail:self.q_tail + n] = sids
        self.q_tail += n

    def _may_admit(self) -> np.ndarray:
        if self.partial:
            return np.array([partial.server_may_admit(bool(x)) for x in self.loading])
        pending = self._global_pending()
        # server_may_admit depends only on (server version, newest, pending): one call per distinct version.
        verdict = {int(v): modes.server_may_admit(self.policy, int(v), self.v_seen, pending)
                   for v in np.unique(self.version)}
        return np.array([verdict[int(v)] for v in self.version]) & ~self.loading

    def _admit(self, t: float) -> None:
        nq = self.q_tail - self.q_head
        if nq == 0:
            return
        occupied = self.sid >= 0
        free = self.M - occupied.sum(1)
        if not (free.any() and (self.used < self.cfg.admit_kv_frac * self.kv_cap).any()):
            return  # every slot taken, or every server's KV at the admission bound: want is all 0
        head = self.queue[self.q_head:self.q_head + min(nq, 4096)]
        per_prompt = math.ceil(float(self.seqs["plen"][head].mean()) / self.cfg.page_tokens) + 1
        room = np.floor((self.cfg.admit_kv_frac * self.kv_cap - self.used) / per_prompt)
        want = np.where(self._may_admit() & ~self.paused.any(1), np.minimum(free, np.maximum(room, 0)), 0)
        want = want.astype(np.int64)
        total = int(want.sum())
        if total == 0:
            return
        if total > nq:  # share a short queue round-robin from a rotating start
            order = np.roll(np.arange(self.S), -(self.rec.ticks % self.S))
            cum = np.cumsum(want[order])
            keep = np.clip(nq - (cum - want[order]), 0, want[order])
            want = np.zeros_like(want)
            want[order] = keep
            total = nq
        # The lowest free slots of each server, row-major (flat indices: np.nonzero on 2-D is slow).
        take = np.flatnonzero(want > 0)
        sub = ~occupied[take]
        flat = np.flatnonzero(sub & (np.cumsum(sub, axis=1) <= want[take, None]))
        rows, cols = take[flat // self.M], flat % self.M
        sids = self.queue[self.q_head:self.q_head + total]
        self.q_head += total
        self._place(rows, cols, sids, t)

    def _place(self, rows, cols, sids, t: float) -> None:
        plen = self.seqs["plen"][sids].astype(np.float64)
        rlen = self.seqs["rlen"][sids].astype(np.float64)
        turns = self.seqs["turns"][sids]
        first = np.ceil(rlen / turns)
        self.sid[rows, cols] = sids
        self.rem[rows, cols] = first
        self.left[rows, cols] = rlen - first
        self.ctx[rows, cols] = plen
        self.ready_t[rows, cols] = t
        self.paused[rows, cols] = False
        self.adm[rows, cols] = t + np.arange(rows.size) * 1e-9
        self.seqs["ver"][sids] = self.version[rows]
        self.seqs["t_adm"][sids] = t
        tok = np.bincount(rows, plen, self.S)
        sq = np.bincount(rows, plen ** 2, self.S)
        self._charge_prefill(tok, sq, t)

    def _charge_prefill(self, tok, sq, t: float) -> None:
        pre = self.cost.prefill_s(tok, sq)
        # shared_host: the server gets its share of the host, as in the last tick's decode.
        wall = pre * self.learner.host_div if self.cfg.shared_host else pre
        self.busy_until = np.where(pre > 0, np.maximum(self.busy_until, t) + wall, self.busy_until)
        self.rec.add_prefill(pre, t)

    # ---- repack -----------------------------------------------------------------------------
    def _repack(self, t: float) -> None:
        """Snapshot servers as ServerViews (see :func:`snapshot_servers`) and execute plan_repack's moves."""
        occ = self.sid >= 0
        live = occ.sum(1)
        used = kv.used_pages(self).astype(np.int64)
        picked = snapshot_servers(live, self.version, ~self.loading, self.cfg.max_batch)
        flat = np.flatnonzero(occ[picked])  # row-major: grouped by picked server
        rows, cols = flat // self.M, flat % self.M
        uids = self.sid[picked[rows], cols].tolist()
        col_of = dict(zip(uids, cols.tolist()))
        pages = np.ceil(self.ctx[picked[rows], cols] / self.cfg.page_tokens).astype(np.int64).tolist()
        bounds = np.concatenate([[0], np.cumsum(live[picked])]).tolist()
        ver, prev, used_l = self.version[picked].tolist(), self.used_prev[picked].tolist(), used[picked].tolist()
        draining = (~self._may_admit())[picked].tolist()  # as the runtime: not admitting = draining
        views = [repack.ServerView(s, ver[i], self.kv_cap, used_l[i], prev[i],
                                   tuple(zip(uids[bounds[i]:bounds[i + 1]], pages[bounds[i]:bounds[i + 1]])),
                                   draining=draining[i], max_live=self.M)
                 for i, s in enumerate(picked.tolist())]
        self.used_prev = used
        params = repack.RepackParams(c_max=self.cfg.c_max, max_batch=self.cfg.max_batch)
        moves = repack.plan_repack(views, params)
        self.rec.repacks += 1
        by_pair: dict[tuple[int, int], list[int]] = {}
        for m in moves:
            by_pair.setdefault((int(m.src), int(m.dst)), []).append(int(m.seq_uid))
        for (src, dst), uids in by_pair.items():
            kv.move(self, src, dst, np.sort(np.array([col_of[u] for u in uids], np.int64)), t)

