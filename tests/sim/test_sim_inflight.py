"""The simulator's in-flight mode: servers swap at once (live sequences and all), so trajectories
span versions; 'reprefill' pays for re-prefilling the kept sequences, 'keep' does not."""

import numpy as np
import pytest

from laminar_jax.sim import SimSection
from laminar_jax.sim.api import cost_model, placement
from laminar_jax.sim.engine import Simulator
from laminar_jax.sim.planner import Candidate, mode_config
from laminar_jax.sim.workload import workload

BASE = dict(model="qwen2.5-7b", gpu="h800", gpus=64, learner_gpus=32, workload="math", duration_s=400.0,
            warmup_s=100.0, min_steps=2, rollout_tp=1)


def _run(**kw):
    cfg = SimSection(**BASE, **kw)
    cost = cost_model(cfg)
    sim = Simulator(cfg, cost, workload(cfg.workload), placement(cfg, cost))
    return sim, sim.run()


def _mixed_groups(sim) -> int:
    """Finished groups whose tokens' mean version is not a whole number (sampled by several versions)."""
    g, n = sim.groups, sim.groups.n
    done = (g["done"][:n] == sim.k) & (g["rtok"][:n] > 0)
    mean_v = g["vtok"][:n][done] / g["rtok"][:n][done]
    return int((np.abs(mean_v - np.round(mean_v)) > 1e-9).sum())


@pytest.fixture(scope="module")
def runs():
    return {name: _run(**kw) for name, kw in {"laminar": dict(mode="laminar"), "keep": dict(mode="inflight"),
                                              "reprefill": dict(mode="inflight", inflight_kv="reprefill")}.items()}


def test_inflight_trajectories_span_versions_and_laminar_ones_do_not(runs):
    assert _mixed_groups(runs["laminar"][0]) == 0
    assert _mixed_groups(runs["keep"][0]) > 0 and _mixed_groups(runs["reprefill"][0]) > 0
    for _, r in runs.values():
        assert r.extra["mean_token_staleness"] >= 0 and r.steps >= 2


def test_reprefill_pays_for_the_kept_sequences_and_keep_does_not(runs):
    keep, rep = runs["keep"][1], runs["reprefill"][1]
    assert keep.mode == "inflight" and rep.mode == "inflight_reprefill"
    assert keep.reprefill_tokens == 0 and rep.reprefill_tokens > 0
    assert keep.repacks == 0 and keep.moves == 0  # no server drains: repack is off


def test_planner_names_map_to_the_mode():
    c = mode_config(SimSection(**BASE), "inflight_reprefill", Candidate(learner_gpus=32, tp=1))
    assert (c.mode, c.inflight_kv) == ("inflight", "reprefill")
