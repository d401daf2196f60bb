"""bench engine --group: GRPO-shaped requests, side by side with every sample prefilled."""

import json

import pytest

from laminar_jax.benchmarks import engine as bench


def test_grouped_workload_keeps_lengths_and_shares_prompts_in_runs_of_group():
    wl = bench.make_workload(12, 4, 40, 100)
    g = bench.grouped(wl, 4)
    assert g.max_new == wl.max_new
    assert all(g.prompts[i] == wl.prompts[i // 4] for i in range(12))


@pytest.mark.slow  # a whole bench run (~27 s on 2 cores); the workload it builds is checked above
def test_group_flag_runs_both_sides_and_reports_the_gain(capsys):
    out = bench.main(["--quick", "--preset", "tiny", "--requests", "16", "--slots", "4", "--median", "4",
                      "--skip-hf", "--group", "4", "--repeats", "1"])
    share = out["share_prompt_kv"]
    assert out["group"] == 4 and share["share_gain"] > 0
    assert share["on"]["cpu_ms_per_1k_tokens"] > 0 and share["off"]["cpu_ms_per_1k_tokens"] > 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["share_prompt_kv"] == share


def test_paired_fractions_compare_each_step_with_the_peak_timed_beside_it():
    """Fakes that sleep (pure timing arithmetic): a step of 100 flops in ~40 ms against a peak of 100
    flops in ~20 ms runs at half the peak's rate, whatever each round's absolute speed."""
    import time

    from laminar_jax.benchmarks.engine_profile import paired_fractions

    r = paired_fractions(lambda: time.sleep(0.04), 100.0, lambda: time.sleep(0.02), 100.0, rounds=3)
    assert r["paired_rounds"] == 3
    assert r["frac_of_peak_min"] <= r["frac_of_peak"] <= r["frac_of_peak_max"]
    assert 0.3 < r["frac_of_peak"] < 0.6  # sleeps overshoot; the step's 2x the peak's time bounds it
    assert r["peak_gflops"] >= r["peak_gflops_median"] > 0
