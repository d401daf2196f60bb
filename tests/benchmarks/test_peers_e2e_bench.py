"""bench peers --e2e (TRL GRPOTrainer against our sync and laminar): arguments, result assembly, and
the quick path's JSON shape (a real run; slow, skipped without trl)."""

import importlib.util

import pytest

from laminar_jax.benchmarks import peers_e2e
from laminar_jax.benchmarks.peers_e2e import parse_args, summarize


def test_parse_args_quick_defaults_and_errors():
    a = parse_args(["--e2e", "--quick"])
    assert (a.budget_s, a.repeats, a.trl_threads, a.systems) == (20.0, 1, [1], ["trl", "sync", "laminar"])
    full = parse_args(["--e2e"])
    assert (full.budget_s, full.repeats, full.trl_threads) == (90.0, 2, [1, 2])
    with pytest.raises(SystemExit, match="--systems"):
        parse_args(["--e2e", "--systems", "trl,verl"])
    with pytest.raises(SystemExit, match="--trl-threads"):
        parse_args(["--e2e", "--trl-threads", "0"])
    assert full.lr == 1e-3 and parse_args(["--e2e", "--lr", "1e-4"]).lr == 1e-4
    with pytest.raises(SystemExit, match="--lr"):
        parse_args(["--e2e", "--lr", "0"])
    assert full.ours_threads == [None] and parse_args(["--e2e", "--ours-threads", "0,1"]).ours_threads == [0, 1]
    with pytest.raises(SystemExit, match="--ours-threads"):
        parse_args(["--e2e", "--ours-threads", "-1"])
    assert full.ours_servers == [(None, None)]
    assert parse_args(["--e2e", "--ours-servers", "1,2"]).ours_servers == [(1, None), (2, None)]
    assert parse_args(["--e2e", "--ours-servers", "2,1x32"]).ours_servers == [(2, None), (1, 32)]
    for bad in ("0", "1x0", "two", "2x"):
        with pytest.raises(SystemExit, match="--ours-servers"):
            parse_args(["--e2e", "--ours-servers", bad])
    assert full.ours_fleet == [None]
    assert parse_args(["--e2e", "--ours-fleet", "threads,processes"]).ours_fleet == ["threads", "processes"]
    with pytest.raises(SystemExit, match="--ours-fleet"):
        parse_args(["--e2e", "--ours-fleet", "ray"])
    assert full.ours_set == []
    assert parse_args(["--e2e", "--ours-set", "learner.pack_shrink=True", "--ours-set", "rollout.decode_steps_per_call=4"]
                      ).ours_set == [("learner.pack_shrink", True), ("rollout.decode_steps_per_call", 4)]
    with pytest.raises(SystemExit):
        parse_args(["--e2e", "--ours-set", "pack_shrink=True"])


def test_a_bad_ours_override_fails_before_any_run(tmp_path):
    with pytest.raises(SystemExit, match="has no key 'no_such_key'"):
        peers_e2e.main(["--e2e", "--ours-set", "learner.no_such_key=1", "--out", str(tmp_path)])
    assert not (tmp_path / "checkpoint").exists()


def test_setting_labels_name_every_setting_given():
    Setting = peers_e2e.Setting
    assert Setting("laminar").label(False) == "laminar"
    assert Setting("laminar", 1, None, 2, "processes").label(False) == "laminar-1t-2srv-proc"
    assert Setting("sync", 0, None, None, "threads").label(False) == "sync-auto-thr"
    assert Setting("laminar", 0, None, 1, "threads", 32).label(False) == "laminar-auto-1x32-thr"
    assert Setting("trl", 1, "keep").label(True) == "trl-1t+keep" and Setting("trl", 1, "keep").label(False) == "trl-1t"


def _run(label, tps, per_cpu, ok=True):
    system = label.split("-")[0]
    if not ok:
        return {"label": label, "system": system, "ok": False, "reason": "No module named 'trl'", "load_avg": 3.0}
    return {"label": label, "system": system, "ok": True, "load_avg": 3.0, "version": label, "train_tps": tps,
            "tokens_per_cpu_s": per_cpu, "cores_busy": tps / per_cpu, "reward_at_budget": 0.3, "heldout_reward": 0.31}


def test_summarize_medians_and_ratios_against_the_best_trl_setting():
    runs = [_run("trl-1t", 1000, 2000), _run("trl-2t", 1500, 1500), _run("sync", 1800, 2500),
            _run("laminar", 2500, 3000), _run("laminar", 2700, 2900), _run("trl-1t", 1200, 2200)]
    s = summarize(runs)
    lam = s["rows"]["laminar"]
    assert lam["runs"] == 2 and lam["train_tps"] == {"median": 2600.0, "min": 2500.0, "max": 2700.0}
    r = s["ratios"]
    assert r["trl_best_per_cpu_s"] == "trl-1t" and r["trl_best_tps"] == "trl-2t"
    assert r["laminar_vs_trl_per_cpu_s"] == pytest.approx(2950 / 2100, abs=1e-3)
    assert r["laminar_vs_trl_tps"] == pytest.approx(2600 / 1500, abs=1e-3)
    assert r["laminar_vs_sync_tps"] == pytest.approx(2600 / 1800, abs=1e-3)


def test_summarize_compares_each_system_at_its_best_setting_per_figure():
    runs = [_run("trl-1t", 1000, 2000), _run("trl-2t", 1500, 1500), _run("sync-auto", 1800, 2500),
            _run("sync-1t", 1600, 2800), _run("laminar-auto", 2600, 2900), _run("laminar-1t", 2400, 3300)]
    r = summarize(runs)["ratios"]
    assert (r["laminar_best_per_cpu_s"], r["trl_best_per_cpu_s"], r["sync_best_per_cpu_s"]) == ("laminar-1t", "trl-1t",
                                                                                                 "sync-1t")
    assert (r["laminar_best_tps"], r["trl_best_tps"], r["sync_best_tps"]) == ("laminar-auto", "trl-2t", "sync-auto")
    assert r["laminar_vs_trl_per_cpu_s"] == pytest.approx(3300 / 2000, abs=1e-3)
    assert r["laminar_vs_sync_per_cpu_s"] == pytest.approx(3300 / 2800, abs=1e-3)
    assert r["laminar_vs_trl_tps"] == pytest.approx(2600 / 1500, abs=1e-3)
    assert r["laminar_vs_sync_tps"] == pytest.approx(2600 / 1800, abs=1e-3)


def test_summarize_bounds_laminar_over_sync_by_every_core_at_its_own_cost():
    """tok/s = cores busy x tokens per CPU-s: with both cores busy at its measured tokens per CPU-s,
    laminar reaches at most 2 x 3000 tok/s, over sync's 1800."""
    runs = [_run("sync", 1800, 2500), _run("laminar", 2400, 3000), _run("laminar", 2600, 3000)]
    r = summarize(runs, cores=2)["ratios"]
    assert r["laminar_vs_sync_core_bound"] == pytest.approx(2 * 3000 / 1800, abs=1e-3)
    assert r["sync_cores_busy"] == pytest.approx(1800 / 2500, abs=1e-3)
    assert r["laminar_cores_busy"] == pytest.approx(2500 / 3000, abs=1e-3)
    assert r["laminar_vs_sync_core_bound"] > r["laminar_vs_sync_tps"]
    old = [{k: v for k, v in run.items() if k != "cores_busy"} for run in runs]  # records without the figure
    assert "laminar_vs_sync_core_bound" not in summarize(old)["ratios"]


def test_summarize_keeps_failures_without_figures():
    s = summarize([_run("trl-1t", 0, 0, ok=False), _run("laminar", 2000, 2000)])
    assert s["rows"]["trl-1t"]["runs"] == 0 and s["rows"]["trl-1t"]["train_tps"] is None
    assert s["rows"]["trl-1t"]["failures"] == ["No module named 'trl'"]
    assert "laminar_vs_trl_tps" not in s["ratios"]


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="trl is not installed (the 'peers' extra)")
def test_quick_path_json_shape(tmp_path, capsys):
    out = peers_e2e.main(["--e2e", "--quick", "--budget-s", "4", "--sft-steps", "5", "--out", str(tmp_path)])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("{") and '"bench": "peers_e2e"' in last
    assert set(out["rows"]) == {"trl-1t", "sync", "laminar"}
    for label, row in out["rows"].items():
        assert row["runs"] == 1, (label, row["failures"])
        assert row["train_tps"]["median"] > 0 and row["tokens_per_cpu_s"]["median"] > 0
        assert 0.0 <= row["heldout_reward"]["median"] <= 1.0
    assert {"laminar_vs_trl_per_cpu_s", "laminar_vs_trl_tps", "laminar_vs_sync_tps"} <= set(out)
    assert len(out["load_avg"]) == 3
