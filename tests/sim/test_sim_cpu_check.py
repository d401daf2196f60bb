"""The simulator held against a real run: the CPU e2e bench, calibrated from its own sync run."""

import os

import pytest

from laminar_jax.sim import cpu_check
from laminar_jax.sim.calibrate import fit

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
FIXTURE = os.path.join(FIXTURES, "e2e_cpu_quick.jsonl")  # quiet machine (load < 5, mostly the run itself)
LOADED = os.path.join(FIXTURES, "e2e_cpu_quick_loaded.jsonl")  # shared with other jobs (load 2.5 -> 11.5)


@pytest.fixture(scope="module", params=["quiet", "loaded"])
def result(request):
    return cpu_check.check(FIXTURE if request.param == "quiet" else LOADED)


@pytest.fixture(scope="module")
def quiet():
    return cpu_check.check(FIXTURE)


@pytest.fixture(scope="module")
def loaded():
    return cpu_check.check(LOADED)


def test_calibrate_reads_the_capture():
    cal = fit([FIXTURE], "tiny", "cpu", 1)
    assert cal["counts"]["learner_rows"] == 1 and 0 < cal["params"]["learner_mfu"] < 1


def test_sync_is_reproduced_by_the_fit(result):
    assert result["modes"]["sync"]["fitted_on"]
    assert abs(result["modes"]["sync"]["ratio"] - 1) < 0.03


@pytest.mark.parametrize("mode", ["one_step", "stream"])
def test_baselines_predicted_within_25_percent(result, mode):  # on either capture
    row = result["modes"][mode]
    assert not row["fitted_on"]
    assert abs(row["ratio"] - 1) <= cpu_check.TOLERANCE, row


def test_shared_host_never_runs_past_a_full_host(result):
    # Processor sharing hands out the host's time, it does not make more of it.
    for mode, row in result["modes"].items():
        assert 0.5 < row["predicted_host_busy"] <= 1.02, (mode, row)


@pytest.mark.parametrize("mode", ["one_step", "stream", "laminar"])
def test_learner_busy_predicted(result, mode):
    # The learner shares the host with generation as a whole (about half of it while servers
    # decode), so its busy fraction in the overlapped modes comes out near the measured one; sharing
    # per thread (1 + servers ways) put it at 0.84-0.93 against a measured 0.41-0.51.
    row = result["modes"][mode]
    assert abs(row["predicted_learner_busy"] - row["measured_learner_busy"]) <= 0.15, row


def test_laminar_predicted_within_25_percent(quiet):
    assert abs(quiet["modes"]["laminar"]["ratio"] - 1) <= cpu_check.TOLERANCE, quiet["modes"]["laminar"]
    assert quiet["ok"]


@pytest.mark.xfail(strict=True, reason="on a machine shared with other jobs the model over-predicts CPU laminar "
                                       "by ~28%: see docs/SIMULATION.md, 'Held against a real run'")
def test_laminar_predicted_within_25_percent_under_load(loaded):
    assert abs(loaded["modes"]["laminar"]["ratio"] - 1) <= cpu_check.TOLERANCE, loaded["modes"]["laminar"]
