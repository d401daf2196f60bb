"""The simulator held against a real run: the CPU e2e bench, calibrated from its own sync run."""

import os

import pytest

from laminar_jax.sim import cpu_check
from laminar_jax.sim.calibrate import fit

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "e2e_cpu_quick.jsonl")


@pytest.fixture(scope="module")
def result():
    return cpu_check.check(FIXTURE)


def test_calibrate_reads_the_capture():
    cal = fit([FIXTURE], "tiny", "cpu", 1)
    assert cal["counts"]["learner_rows"] == 1 and 0 < cal["params"]["learner_mfu"] < 1


def test_sync_is_reproduced_by_the_fit(result):
    assert result["modes"]["sync"]["fitted_on"]
    assert abs(result["modes"]["sync"]["ratio"] - 1) < 0.03


@pytest.mark.parametrize("mode", ["one_step", "stream"])
def test_baselines_predicted_within_25_percent(result, mode):
    row = result["modes"][mode]
    assert not row["fitted_on"]
    assert abs(row["ratio"] - 1) <= cpu_check.TOLERANCE, row


@pytest.mark.xfail(strict=True, reason="the model over-predicts CPU laminar by ~40%: see docs/SIMULATION.md, "
                                       "'Held against a real run'")
def test_laminar_predicted_within_25_percent(result):
    assert abs(result["modes"]["laminar"]["ratio"] - 1) <= cpu_check.TOLERANCE, result["modes"]["laminar"]
