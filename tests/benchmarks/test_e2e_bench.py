"""bench e2e: its arguments (--set overrides, the agentic workload's slot release) and the engine-alone
figure (the run's servers with the machine to themselves)."""

import argparse
import os
import types

import pytest

from laminar_jax.benchmarks import e2e


def test_set_parses_literals_and_strings():
    assert e2e.parse_override("scheduler.admit_lag=2") == ("scheduler.admit_lag", 2)
    assert e2e.parse_override("buffer.max_staleness=None") == ("buffer.max_staleness", None)
    assert e2e.parse_override("runtime.mode=laminar") == ("runtime.mode", "laminar")
    with pytest.raises(argparse.ArgumentTypeError, match="section.key=value"):
        e2e.parse_override("admit_lag=2")


def test_set_changes_the_workload_config_and_names_a_bad_key():
    args = types.SimpleNamespace(workload="agentic", env_median_s=1.5)
    c = e2e._workload_config(args)
    assert c.env.release_slot_while_waiting and c.env.env_kwargs["latency"]["median_s"] == 1.5
    e2e.set_config_key(c, "scheduler.admit_lag", 3)
    assert c.scheduler.admit_lag == 3
    with pytest.raises(SystemExit, match="has no key 'admit_lagg'"):
        e2e.set_config_key(c, "scheduler.admit_lagg", 3)
    with pytest.raises(SystemExit, match="no section 'schedulr'"):
        e2e.set_config_key(c, "schedulr.admit_lag", 3)


def test_agentic_workload_releases_slots_and_admits_two_versions_behind():
    c = e2e._workload_config(types.SimpleNamespace(workload="agentic", env_median_s=3.0))
    assert c.env.release_slot_while_waiting and c.scheduler.admit_lag == 2 and c.runtime.max_inflight_batches == 3
    e2e.set_config_key(c, "env.release_slot_while_waiting", False)  # the comparison the docs name
    assert not c.env.release_slot_while_waiting
    # the test variants keep their slots: the mid-episode resume test runs episodes in slots
    from laminar_jax.config import repo_config
    assert not repo_config("agentic_demo", "short").env.release_slot_while_waiting


@pytest.mark.slow  # the run's servers fed for a budget (~18 s on 2 cores); the servers are tested in tests/rollout
def test_engine_alone_drives_the_runs_own_servers_and_counts_finished_tokens(tmp_path):
    """The loop-efficiency denominator: the laminar mode's servers (count, slots, tokens per call from
    the bench's arguments) run fed for the budget, then every thread has stopped."""
    import threading

    args = types.SimpleNamespace(workload="demo", servers=2, slots=4, prompts_per_step=8, profile=False,
                                 decode_steps=2, set=[("rollout.max_new_tokens", 16)])
    cfg = e2e.mode_config("laminar", None, 1.0, str(tmp_path), args)  # the demo's tiny preset, untrained
    assert cfg.rollout.num_slots == 4 and cfg.rollout.decode_steps_per_call == 2 and cfg.runtime.num_servers == 2
    out = e2e.engine_alone(cfg, 1.0)
    assert out["servers"] == 2 and out["slots"] == 4 and out["wall_s"] >= 1.0
    # at most 16 tokens per sequence: many sequences finished in a second
    assert out["gen_tokens"] > 16 * 8
    assert abs(out["gen_tokens_per_s"] - out["gen_tokens"] / out["wall_s"]) < 0.01 * out["gen_tokens_per_s"]
    assert 0.1 < out["cpu_cores_busy"] <= (os.cpu_count() or 1) + 0.5  # process CPU over the window's wall
    assert not [t for t in threading.enumerate() if t.name.startswith("engine-alone-")]


def test_loop_efficiency_is_cores_times_cost_and_bounded_by_all_cores():
    """gen tok/s = cores busy / CPU per generated token: the efficiency splits exactly into the two
    ratios, and the bound puts every core to work at the loop's own cost per token."""
    alone = {"gen_tokens_per_s": 10_000.0, "cpu_cores_busy": 1.9}
    p = e2e.loop_efficiency(6_000.0, 1.5, alone, cores=2)
    assert p["efficiency"] == 0.6
    assert abs(p["cores_ratio"] * p["cost_ratio"] - p["efficiency"]) < 2e-3
    # the loop spends 1.5 / 6000 CPU-s per generated token, the engine alone 1.9 / 10000
    assert p["cost_ratio"] == round((1.9 / 10_000) / (1.5 / 6_000), 3)
    assert p["bound"] == round(2 / 1.9 * p["cost_ratio"], 3)
    assert p["bound"] > p["efficiency"]
    # no CPU figure (a run under Ray, or an older engine-alone record): the efficiency alone
    q = e2e.loop_efficiency(6_000.0, None, alone, cores=2)
    assert q["efficiency"] == 0.6 and q["cores_ratio"] is q["cost_ratio"] is q["bound"] is None
