"""The simulator runs the runtime's own policy functions (same objects, looked up at call time)."""

import random


import laminar_jax.buffer.policies as policies
import laminar_jax.scheduler.modes as modes
import laminar_jax.scheduler.repack as repack
from laminar_jax.sim import SimSection, engine, simulate


def cfg(**kw):
    base = dict(model="qwen2.5-0.5b", gpus=32, learner_gpus=16, duration_s=600.0, warmup_s=100.0, mode="laminar")
    base.update(kw)
    return SimSection(**base)


def test_same_function_objects_as_runtime():
    from laminar_jax.buffer import dispatch

    assert engine.modes is modes and engine.repack is repack and engine.policies is policies
    assert dispatch.dispatch_allowance is modes.dispatch_allowance  # the runtime's dispatcher uses this one


def test_dispatch_gate_is_the_scheduler_function(monkeypatch):
    assert simulate(cfg()).trajectories > 0
    monkeypatch.setattr(modes, "dispatch_allowance", lambda *a, **k: 0)
    assert simulate(cfg()).trajectories == 0


def test_admission_and_swap_are_the_scheduler_functions(monkeypatch):
    ok = simulate(cfg(mode="stream"))
    monkeypatch.setattr(modes, "swap_now", lambda *a, **k: False)  # servers never take new weights
    stuck = simulate(cfg(mode="stream"))
    assert stuck.tokens_per_s < 0.5 * ok.tokens_per_s
    monkeypatch.undo()
    monkeypatch.setattr(modes, "server_may_admit", lambda *a, **k: False)
    assert simulate(cfg(mode="stream")).trajectories == 0


def test_repack_and_selection_are_the_project_functions(monkeypatch):
    calls = {"plan": 0, "select": 0}
    real_plan, real_select = repack.plan_repack, policies.select_fifo

    def spy_plan(servers, params):
        calls["plan"] += 1
        assert all(isinstance(s, repack.ServerView) for s in servers)
        return real_plan(servers, params)

    def spy_select(*a, **k):
        calls["select"] += 1
        return real_select(*a, **k)

    monkeypatch.setattr(repack, "plan_repack", spy_plan)
    monkeypatch.setattr(policies, "select_fifo", spy_select)
    base = simulate(cfg())
    assert base.moves > 0 and calls["plan"] >= 600 / 5 and calls["select"] >= base.steps
    monkeypatch.setattr(repack, "plan_repack", lambda servers, params: [])
    off = simulate(cfg())
    assert off.moves == 0 and off.tokens_per_s != base.tokens_per_s


def _random_views(rng, n):
    views = []
    for i in range(n):
        live = rng.choice([0, 0, 0, 1, 3, 10, 63, 64, 100])
        seqs = tuple((f"s{i}.{j}", rng.randint(1, 40)) for j in range(live))
        used = sum(p for _, p in seqs)
        views.append(repack.ServerView(i, rng.choice([3, 4]), 2000, used, used + rng.choice([-5, 5]), seqs))
    return views


def test_snapshot_reduction_gives_the_same_plan():
    import numpy as np

    rng = random.Random(0)
    params = repack.RepackParams(c_max=0.99, max_batch=64)
    for _ in range(200):
        views = _random_views(rng, rng.randint(1, 40))
        live = np.array([v.live for v in views])
        version = np.array([v.version for v in views])
        keep = engine.snapshot_servers(live, version, np.ones(len(views), bool), params.max_batch)
        # Version groups are planned independently, in order of first appearance in the list; the
        # reduced list may meet them in another order, so compare the moves as a multiset.
        key = lambda m: (m.src, m.dst, m.seq_uid)
        assert sorted(repack.plan_repack([views[i] for i in keep], params), key=key) == \
            sorted(repack.plan_repack(views, params), key=key)


def test_partial_rollout_is_sim_policy_on_modes_formula():
    from laminar_jax.sim import partial

    assert partial.dispatch_allowance(3, 30, 10, 2) == modes.dispatch_allowance(
        modes.ModePolicy("x", "global", False, None, True), 3, 30, 10, 2) == (2 + 3 + 1) * 10 - 30
    r = simulate(cfg(mode="partial_rollout"))
    assert r.trajectories > 0 and r.reprefill_tokens > 0 and r.moves == 0
