"""The simulator's KV accounting: pages held per server, recompute preemption when a server's KV
is over-full (vLLM's policy), resuming paused sequences with a re-prefill, and repack's moves of
sequences between servers. Functions of a Simulator's slot arrays (``sim``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from laminar_jax.sim.engine import Simulator


def held_slots(sim: "Simulator") -> np.ndarray:
    """Flat indices of the slots holding KV (live, not paused), ascending."""
    f = sim._flat
    occ = np.flatnonzero(f["sid"] >= 0)
    return occ[~f["paused"][occ]]


def used_pages(sim: "Simulator") -> np.ndarray:
    """KV pages held per server, f64[S] (whole pages per sequence: exact in any order)."""
    held = held_slots(sim)
    pages = np.ceil(sim._flat["ctx"][held] / sim.cfg.page_tokens)
    return np.bincount(held // sim.M, weights=pages, minlength=sim.S)


def row_pages(sim: "Simulator", s: int) -> np.ndarray:
    """KV pages held per slot of server s, f64[M] (paused sequences hold none)."""
    held = (sim.sid[s] >= 0) & ~sim.paused[s]
    return np.where(held, np.ceil(sim.ctx[s] / sim.cfg.page_tokens), 0.0)


def preempt(sim: "Simulator") -> None:
    """Over-full KV: pause the most recently admitted sequences (vLLM recompute preemption).

    Leaves ``sim.used`` (pages per server) current for the next tick's admission and metrics.
    """
    used = used_pages(sim)
    sim.used = used
    for s in np.nonzero(used > sim.kv_cap)[0]:
        pages = row_pages(sim, s)
        cand = np.nonzero((sim.sid[s] >= 0) & ~sim.paused[s])[0]
        cand = cand[np.argsort(-sim.adm[s, cand])]
        excess = used[s] - sim.kv_cap
        freed = np.cumsum(pages[cand])
        n = int(np.searchsorted(freed, excess)) + 1
        sim.paused[s, cand[:n]] = True
        sim.rec.preemptions += n
        sim.used[s] -= pages[cand[:n]].sum()


def resume_paused(sim: "Simulator", t: float) -> None:
    any_paused = sim.paused.any(1) & ~sim.loading
    if not any_paused.any():
        return
    for s in np.nonzero(any_paused)[0]:
        used = row_pages(sim, s).sum()
        idx = np.nonzero(sim.paused[s])[0]
        idx = idx[np.argsort(sim.adm[s, idx])]
        need = np.cumsum(np.ceil(sim.ctx[s, idx] / sim.cfg.page_tokens))
        n = int(np.searchsorted(need, sim.cfg.admit_kv_frac * sim.kv_cap - used, side="right"))
        if n:
            back = idx[:n]
            sim.paused[s, back] = False
            c = sim.ctx[s, back]
            sim.used[s] += np.ceil(c / sim.cfg.page_tokens).sum()
            tok, sq = np.zeros(sim.S), np.zeros(sim.S)
            tok[s], sq[s] = c.sum(), (c ** 2).sum()
            sim._charge_prefill(tok, sq, t)
            sim.rec.reprefill_tokens += float(c.sum())


def move(sim: "Simulator", src: int, dst: int, src_cols: np.ndarray, t: float) -> None:
    """Move the sequences in src's slots ``src_cols`` (ascending) to dst's lowest free slots."""
    if int(sim.version[src]) != int(sim.version[dst]):
        raise AssertionError(f"repack moved sequences across versions ({src}->{dst})")
    dst_cols = np.nonzero(sim.sid[dst] < 0)[0][:src_cols.size]
    if dst_cols.size < src_cols.size:
        raise AssertionError(f"repack destination {dst} has no free slot")
    pages = np.ceil(sim.ctx[src, src_cols] / sim.cfg.page_tokens).sum()
    arrive = t + float(sim.cost.kv_move_s(pages))
    for a in (sim.sid, sim.rem, sim.left, sim.ctx, sim.ready_t, sim.paused, sim.adm):
        a[dst, dst_cols] = a[src, src_cols]
    sim.ready_t[dst, dst_cols] = np.maximum(sim.ready_t[dst, dst_cols], arrive)
    sim.sid[src, src_cols] = -1
    sim.paused[src, src_cols] = False
    sim.rec.moves += src_cols.size
    sim.rec.moved_pages += float(pages)
