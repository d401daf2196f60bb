"""The e2e capture the simulator's CPU check reads (laminar_jax/benchmarks/e2e_capture.py)."""

from laminar_jax.benchmarks import e2e_capture
from laminar_jax.sim import cpu_check


def test_capture_keeps_each_modes_figures_and_load(tmp_path, monkeypatch):
    # The e2e bench itself is minutes of CPU: a fake run_mode/main stand in for it here; the stored
    # fixtures in tests/sim/fixtures are real captures.
    import types

    from laminar_jax.benchmarks import e2e

    def fake_run_mode(mode, model_dir, budget_s, run_root, args):
        return {k: 1.0 for k in e2e_capture._KEEP}

    def fake_main(argv):
        args = types.SimpleNamespace(servers=4, slots=8, prompts_per_step=8)
        for mode in ("sync", "laminar"):
            e2e.run_mode(mode, "", 1.0, "", args)
        return {"bench": "e2e"}

    monkeypatch.setattr(e2e, "run_mode", fake_run_mode)
    monkeypatch.setattr(e2e, "main", fake_main)
    path = str(tmp_path / "capture.jsonl")
    e2e_capture.capture(path, modes=("sync", "laminar"))
    rec = cpu_check.load_capture(path)
    assert set(rec["modes"]) == {"sync", "laminar"} and rec["host_cpus"] >= 1
    assert len(rec["modes"]["laminar"]["loadavg"]) == 2 and rec["modes"]["laminar"]["run"]["servers"] == 4
    assert e2e.run_mode is fake_run_mode  # put back
