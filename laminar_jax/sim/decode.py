"""The simulator's decode ticks: every server advances its active slots by as many decode steps as
its share of the tick allows (step time from the cost model at its batch and context); sequences
that end a turn wait on their environment, finished ones complete their groups into the buffer.
Functions of a Simulator's slot arrays (``sim``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from laminar_jax.buffer import policies
from laminar_jax.sim.workload import env_latency

if TYPE_CHECKING:
    from laminar_jax.sim.engine import Simulator


def _dense_sum(sim: "Simulator", idx: np.ndarray, values: np.ndarray, per_server: bool = False):
    """Sum of ``values`` at flat slots ``idx`` (per server, or in all), zeros elsewhere: the same
    additions in the same order as summing the whole [S, M] array, so the result is identical."""
    buf = sim._scratch
    buf[idx] = values
    out = buf.reshape(sim.S, sim.M).sum(1) if per_server else buf.sum()
    buf[idx] = 0.0
    return out


def decode(sim: "Simulator", t: float, t1: float) -> None:
    S, M, f = sim.S, sim.M, sim._flat
    occ = np.flatnonzero(f["sid"] >= 0)
    idx = occ[~f["paused"][occ] & (f["ready_t"][occ] <= t)]  # active slots, ascending (row-major)
    row = idx // M
    b = np.bincount(row, minlength=S)
    avail = np.clip(t1 - np.maximum(t, sim.busy_until), 0.0, t1 - t)
    avail[b == 0] = 0.0
    if sim.cfg.shared_host:
        avail = avail / sim.learner.host_divisor(int((b > 0).sum()), t1 - t)
    ctx_a = f["ctx"][idx]
    ctx_sum = _dense_sum(sim, idx, ctx_a, per_server=True)
    tau = sim.cost.decode_step_s(b, ctx_sum)
    steps = np.divide(avail, tau, out=np.zeros(S), where=tau > 0)
    tau = sim.cost.decode_step_s(b, ctx_sum + b * steps / 2)  # context grows during the tick
    steps = np.divide(avail, tau, out=np.zeros(S), where=tau > 0)
    rem_a = f["rem"][idx]
    adv = np.minimum(rem_a, steps[row])
    left_a = rem_a - adv
    f["rem"][idx] = left_a
    f["ctx"][idx] = ctx_a + adv
    # Each token's version summed per sequence (per-token staleness): a loading server decodes only
    # after its load, under the version it loads. Slots hold distinct sequences: a plain scatter-add.
    ver = np.where(sim.loading, sim.load_target, sim.version)
    sim.seqs["vtok"][f["sid"][idx]] += adv * ver[row]
    sim.rec.tokens_generated += float(_dense_sum(sim, idx, adv))
    rmax = np.zeros(S)
    np.maximum.at(rmax, row, rem_a)
    need = np.where(b > 0, rmax * tau, 0.0)
    sim.rec.add_decode(np.minimum(avail, need), t)
    done = left_a <= 0
    if not done.any():
        return
    rows, cols = row[done], idx[done] - row[done] * M
    start = t1 - avail[rows]
    finish = start + rem_a[done] / np.maximum(steps[rows], 1e-12) * avail[rows]
    more = sim.left[rows, cols] > 0
    if more.any():
        _next_turn(sim, rows[more], cols[more], finish[more], t)
    fin = ~more
    _complete(sim, rows[fin], cols[fin], finish[fin])


def _next_turn(sim: "Simulator", rows, cols, finish, t: float) -> None:
    """Multi-turn: the environment answers after its latency; its tokens are prefilled."""
    sids = sim.sid[rows, cols]
    turn = np.ceil(sim.seqs["rlen"][sids] / sim.seqs["turns"][sids])
    nxt = np.minimum(turn, sim.left[rows, cols])
    sim.rem[rows, cols] = nxt
    sim.left[rows, cols] -= nxt
    sim.ready_t[rows, cols] = finish + env_latency(sim.work, rows.size, sim.rng)
    obs = float(sim.work.obs_tokens)
    sim.ctx[rows, cols] += obs
    tok = np.bincount(rows, np.full(rows.size, obs), sim.S)
    sq = np.bincount(rows, np.full(rows.size, obs * obs), sim.S)
    sim._charge_prefill(tok, sq, t)


def _complete(sim: "Simulator", rows, cols, finish) -> None:
    sids = sim.sid[rows, cols]
    sim.sid[rows, cols] = -1
    if sids.size == 0:
        return
    s = sim.seqs
    turns = s["turns"][sids]
    tokens = s["plen"][sids] + s["rlen"][sids] + (turns - 1) * sim.work.obs_tokens
    s["t_fin"][sids] = finish
    gids = sids // sim.k
    g = sim.groups
    np.add.at(g["done"], gids, 1)
    np.maximum.at(g["ready"], gids, finish + sim.work.reward_latency_s)
    np.minimum.at(g["ver"], gids, s["ver"][sids])
    np.add.at(g["tok"], gids, tokens)
    np.add.at(g["vtok"], gids, s["vtok"][sids])
    np.add.at(g["rtok"], gids, s["rlen"][sids].astype(np.float64))
    sim.rec.trajectories += sids.size
    full = np.unique(gids[g["done"][gids] == sim.k])
    full = full[np.argsort(g["ready"][full], kind="stable")]
    for gid in full.tolist():
        rows_ = tuple(range(gid * sim.k, (gid + 1) * sim.k))
        meta = policies.GroupMeta(str(gid), rows_, int(g["ver"][gid]), int(g["tok"][gid]), sim.group_seq)
        sim.group_seq += 1
        sim.buf.append((float(g["ready"][gid]), meta))
