"""bench env --sandbox: a few tool calls per mode give a row each and the JSON line (no timing goal here)."""

import json

import pytest

from laminar_jax.benchmarks import env as env_bench
from laminar_jax.env.bwrap import sandbox_problem


def test_sandbox_bench_times_both_modes(capsys):
    out = env_bench.main(["--sandbox", "--calls", "3"])
    assert out["bench"] == "env" and out["calls"] == 3 and out["goal_p50_ms"] == 50.0
    un = out["rows"]["unsandboxed"]
    assert un["calls"] == 3 and 0 < un["p50_ms"] <= un["p99_ms"] and un["calls_per_s"] > 0
    sb = out["rows"]["sandboxed"]
    if sandbox_problem() is None:
        assert sb["calls"] == 3 and 0 < sb["p50_ms"] <= sb["p99_ms"] and out["p50_overhead_ms"] is not None
    else:
        assert "apt-get install bubblewrap" in sb["unavailable"] or "namespaces" in sb["unavailable"]
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["bench"] == "env"


def test_the_bench_needs_what_to_measure():
    with pytest.raises(SystemExit):
        env_bench.main([])
