"""runtime.mode='inflight' end to end on the demo's short variant: servers take each new version
between decode calls without draining, so trajectories span versions (each token stamped with its
own); nothing is lost or repeated, through swaps and through the chaos schedule's kills."""

import pytest

from laminar_jax.config import ConfigError, finalize, repo_config


def _inflight(tmp_path, kv: str):
    c = repo_config("demo", "short")
    c.runtime.mode = "inflight"
    c.rollout.inflight_kv = kv
    c.runtime.total_steps = 5
    c.runtime.run_dir = str(tmp_path / kv)
    # Generation, not the learner, must be the bottleneck, so that every new version reaches a server
    # with live sequences, whatever the machine's load: one server of 2 slots, 2 tokens a call, generates
    # (busy ~90% of the run); the learner trains one padded shape (unpacked, one bucket), compiled by
    # its warm-up, so its steps are short (busy 30-40%).
    # With the demo's 2 servers of 16 slots, they finished each batch before the next version came and
    # a run could train no trajectory that spanned versions.
    c.runtime.num_servers = 1
    c.rollout.num_slots = 2
    c.rollout.decode_steps_per_call = 2
    c.learner.pack_length = 0
    c.learner.seq_len_buckets = (c.rollout.max_total_len,)
    c.learner.compile_ahead = "all"
    # A third batch in flight keeps the server generating while the learner trains.
    c.runtime.max_inflight_batches = 3
    return c


@pytest.mark.parametrize("kv", ["keep", pytest.param("reprefill", marks=pytest.mark.slow)])
def test_inflight_mode_runs_with_per_token_versions(tmp_path, kv):
    from laminar_jax.runtime.local import run_local

    c = _inflight(tmp_path, kv)
    s = run_local(finalize(c))
    assert s["steps"] == c.runtime.total_steps and not s["stopped_early"]
    assert s["lost_prompts"] == 0 and s["duplicated_prompts"] == 0
    assert s["consumed_prompts"] == c.runtime.total_steps * c.runtime.prompts_per_step
    # Swaps landed mid-generation: some trained trajectories were sampled by two versions or more.
    assert s["mixed_version_frac"] > 0.0, s
    assert s["max_token_staleness"] >= 0 and s["mean_token_staleness"] <= s["max_token_staleness"]


@pytest.mark.slow
def test_inflight_chaos_schedule_completes_without_loss(tmp_path):
    from laminar_jax.benchmarks import faults

    result = faults.main(["--quick", "--out", str(tmp_path), "--set", "runtime.mode=inflight",
                          "--set", "learner.compile_ahead=none"])
    assert result["completed"] and result["killed"] == ["rollout", "relay", "learner"]
    assert result["lost_prompts"] == 0 and result["duplicated_prompts"] == 0
    assert result["consumed_prompts"] == result["expected_prompts"]


def test_finalize_refuses_reprefill_outside_inflight_and_with_released_episodes(tmp_path):
    c = repo_config("demo", "short")
    c.rollout.inflight_kv = "reprefill"
    with pytest.raises(ConfigError, match=r"rollout.inflight_kv='reprefill'.*runtime.mode='inflight'"):
        finalize(c)
    c.runtime.mode = "inflight"
    finalize(c)  # the combination that works
    c.env.enabled = True
    c.env.release_slot_while_waiting = True
    with pytest.raises(ConfigError, match=r"rollout.inflight_kv='reprefill'.*env.release_slot_while_waiting"):
        finalize(c)
