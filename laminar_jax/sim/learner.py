"""The simulator's learner, in continuous time: it takes a batch from the buffer with the runtime's
own selection (laminar_jax.buffer.policies.select_fifo, looked up at call time), trains for the cost
model's step time and publishes the new version (after its device-to-host copy). With
``shared_host`` it shares the host with the decoding servers (processor sharing between planes)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from laminar_jax.buffer import policies

if TYPE_CHECKING:
    from laminar_jax.sim.engine import Simulator

# shared_host: the learner's share of the host while servers decode. The planes share it, not the
# threads: every server's decode loop runs under one interpreter lock, so generation as a whole
# competes with the learner as one claimant (a CPU run's learner step takes ~2x its time alone
# while servers decode, not 1 + servers times; docs/SIMULATION.md, "Held against a real run").
LEARNER_HOST_SHARE = 0.5


class SimLearner:
    """The learner's clock and the versions it published; reads the Simulator's buffer of complete
    groups (``sim.buf``) and consumes from it."""

    def __init__(self, sim: "Simulator"):
        self.sim = sim
        self.steps = 0  # learner version = steps trained
        self.free = 0.0
        # shared_host: the running step's (start, tokens, staleness) and host-seconds of work left;
        # its end is found tick by tick, as its share of the host depends on the servers decoding.
        self.running: tuple | None = None
        self.work = 0.0
        self.n_decoding = 0  # servers decoding in the current tick
        self.host_div = 1.0  # and the divisor of their share of the host
        self.publish_t = [0.0]  # publish_t[v]: version v at the master relay (v0 preloaded)

    def host_divisor(self, n: int, dt: float) -> float:
        """shared_host: the n decoding servers each get dt / divisor host-seconds of the tick.

        Processor sharing between two planes: while the learner trains and servers decode, the
        learner gets LEARNER_HOST_SHARE of the host and the servers split the rest equally; the
        learner counts for the part of the tick its step still needs at that share.
        """
        self.n_decoding = n
        lam = _share(n)
        a = min(1.0, self.work / lam / dt) if self.running is not None and n > 0 else 0.0
        self.host_div = max(1.0, n / (1.0 - a * lam))
        return self.host_div

    def _progress(self, t: float, t1: float) -> float | None:
        """shared_host: advance the running step by its host share this tick; its end, or None."""
        s0 = max(t, self.running[0])
        rate = _share(self.n_decoding)
        if self.work <= (t1 - s0) * rate:
            end, self.work = s0 + self.work / rate, 0.0
            return end
        self.work -= (t1 - s0) * rate
        return None

    def advance(self, t: float, t1: float) -> None:
        """Start (and, on a shared host, finish) every learner step that can by t1 (continuous time)."""
        sim = self.sim
        while True:
            if self.running is not None:
                end = self._progress(t, t1)
                if end is None:
                    return
                (start, tokens, stale), self.running = self.running, None
                self._end_step(start, end, tokens, stale)
            if not (self.free <= t1 and len(sim.buf) >= sim.B):
                return
            ready_times = sorted(rt for rt, _ in sim.buf)
            td = max(self.free, ready_times[sim.B - 1])
            if td > t1:
                return
            avail = [m for rt, m in sim.buf if rt <= td]
            sel = policies.select_fifo(avail, sim.B, self.steps, sim.cfg.buffer_max_staleness, "drop")
            gone = {m.group for m in sel.take} | {m.group for m in sel.drop}
            sim.buf = [(rt, m) for rt, m in sim.buf if m.group not in gone]
            sim.rec.dropped += len(sel.drop)
            sim.consumed += len(sel.take) + len(sel.drop)
            if not sel.take:
                if not sel.drop:
                    return  # the policy declined: try again next tick
                continue
            tokens = sum(m.num_tokens for m in sel.take)
            stale = [policies.staleness(self.steps, m.version) for m in sel.take]
            # Per token: steps - the version that sampled it, summed over the batch's generated tokens.
            g = [int(m.group) for m in sel.take]
            rtok = float(sim.groups["rtok"][g].sum())
            sim.rec.token_staleness(td, self.steps * rtok - float(sim.groups["vtok"][g].sum()), rtok)
            dur = sim.cost.learner_step_s(tokens, sim.place.learner_gpus)
            if sim.cfg.shared_host:  # the end depends on the host share it gets: found tick by tick
                self.running, self.work, self.free = (td, tokens, stale), dur, math.inf
                sim.rec.learner_work(td, dur)
                continue
            self._end_step(td, td + dur, tokens, stale)

    def _end_step(self, start: float, end: float, tokens: int, stale: list[int]) -> None:
        sim = self.sim
        if sim.cfg.colocate:  # onload optimizer state before, offload after (PCIe, all GPUs)
            end += 2 * sim.cost.train_state_offload_s(sim.place.learner_gpus)
        sim.rec.step(start, end, tokens, stale)
        self.steps += 1
        self.free = end + sim.d2h_s
        self.publish_t.append(self.free)


def _share(n_decoding: int) -> float:
    """The learner's share of the host while ``n_decoding`` servers decode."""
    return 1.0 if n_decoding == 0 else LEARNER_HOST_SHARE
