"""The relay bench's poll-cost mode runs both ways on loopback and reports per-poll CPU (no timing goal here)."""

from laminar_jax.benchmarks import relay


def test_poll_cost_reports_both_modes():
    out = relay.bench_polls(polls=20, reps=1)
    assert out["bench"] == "relay_polls" and out["reps"] == 1
    for mode in ("kept", "fresh"):
        assert out[f"{mode}_cpu_ms_per_poll"] >= 0.0
        lo, hi = out[f"{mode}_range"]
        assert lo <= out[f"{mode}_cpu_ms_per_poll"] <= hi
    assert "fresh_vs_kept" in out and len(out["load_avg"]) == 3


def test_poll_cost_flag_parses():
    assert relay.parse_args(["--poll-cost", "--reps", "2"]).poll_cost
