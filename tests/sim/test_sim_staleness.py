"""What keeps staleness low: the runtime's back-pressure and queue bound, and the planner's target."""


import laminar_jax.scheduler.modes as modes
from laminar_jax.sim import SimSection, simulate
from laminar_jax.sim.planner import search_mode, within_target


def cfg(**kw):
    base = dict(model="qwen2.5-0.5b", gpus=32, learner_gpus=16, duration_s=900.0, warmup_s=200.0, min_steps=3,
                mode="laminar", prompts_per_step=64)
    base.update(kw)
    return SimSection(**base)


def test_back_pressure_bounds_staleness():
    free = simulate(cfg(max_inflight_batches=None))  # slots only: 16 servers x 256 = 256 prompts in flight
    held = simulate(cfg(max_inflight_batches=2))  # the runtime's default
    assert free.mode == "laminar_unbounded" and held.mode == "laminar"
    assert free.mean_staleness > 2.0
    assert held.mean_staleness <= 1.5 and held.p99_staleness <= 4
    assert free.mean_staleness > 2 * held.mean_staleness
    assert held.tokens_per_s < free.tokens_per_s  # the price: fewer sequences in flight


def test_back_pressure_goes_through_the_runtime_function(monkeypatch):
    seen = []
    real = modes.dispatch_allowance

    def spy(*a, **k):
        seen.append(a[5] if len(a) > 5 else k.get("max_inflight_batches"))
        return real(*a, **k)

    monkeypatch.setattr(modes, "dispatch_allowance", spy)
    simulate(cfg(max_inflight_batches=3, duration_s=300.0, warmup_s=50.0, min_steps=0))
    assert seen and set(seen) == {3}


def test_queue_bound_is_the_runtime_function(monkeypatch):
    assert simulate(cfg(duration_s=300.0, warmup_s=50.0, min_steps=0)).trajectories > 0
    monkeypatch.setattr(modes, "queue_room", lambda *a, **k: 0)
    assert simulate(cfg(duration_s=300.0, warmup_s=50.0, min_steps=0)).trajectories == 0


def test_one_version_per_global_batch_in_every_mode():
    for mode in ("sync", "one_step", "stream", "partial_rollout", "laminar"):
        assert SimSection(mode=mode).steps_prompts() == 512
    assert SimSection(mode="laminar", prompts_per_step=128).steps_prompts() == 128


def test_planner_keeps_laminar_within_the_staleness_target():
    base = cfg(learner_gpus=None, duration_s=600.0, max_mean_staleness=1.0, max_p99_staleness=3.0)
    row = search_mode(base, "laminar", points=2, refine=0, search_tp=False)
    assert row.label == "ok" and row.best.inflight is not None
    assert row.result.mean_staleness <= 1.0 and row.result.p99_staleness <= 3.0
    unb = search_mode(base, "laminar_unbounded", points=2, refine=0, search_tp=False)
    assert unb.label == "unbounded"


def test_planner_labels_a_mode_that_cannot_meet_the_target():
    base = cfg(learner_gpus=None, duration_s=600.0, max_mean_staleness=0.0, max_p99_staleness=0.0)
    row = search_mode(base, "one_step", points=2, refine=0, search_tp=False)  # staleness 1 by design
    assert row.label == "over target" and not within_target(base, row.result)
