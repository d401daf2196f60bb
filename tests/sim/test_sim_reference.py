"""Same seed, same figures: the simulator's results for a fixed set of runs, stored when they were
last known right, so that a speed-up of the simulator (which must not change what it predicts) is
checked against them. Regenerate only for an intended model change:

    python tests/sim/test_sim_reference.py --write
"""

import json
import math
import os
import sys

import pytest

from laminar_jax.sim import SimSection, simulate

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "sim_reference.json")
BASE = dict(model="qwen2.5-7b", gpu="h800", gpus=64, learner_gpus=32, workload="math", duration_s=600.0,
            warmup_s=150.0, min_steps=3)
RUNS = {
    "sync_colocated": dict(BASE, mode="sync", colocate=True, learner_gpus=None, rollout_tp=2),
    "one_step": dict(BASE, mode="one_step", rollout_tp=2),
    "stream": dict(BASE, mode="stream", rollout_tp=2),
    "partial_rollout": dict(BASE, mode="partial_rollout", rollout_tp=2),
    "laminar": dict(BASE, mode="laminar", rollout_tp=1, max_inflight_batches=3),
    "laminar_norepack": dict(BASE, mode="laminar", repack=False, rollout_tp=1),
    "laminar_unbounded": dict(BASE, mode="laminar", max_inflight_batches=None, rollout_tp=1),
    "laminar_agentic": dict(BASE, mode="laminar", workload="agentic", rollout_tp=2),
    "laminar_kv_bound": dict(BASE, mode="laminar", rollout_tp=1, admit_kv_frac=1.0, max_num_seqs=512,
                             max_inflight_batches=4),
    "laminar_1024": dict(BASE, mode="laminar", gpus=1024, learner_gpus=512, rollout_tp=2, duration_s=300.0,
                         warmup_s=100.0),
    # KV preemption and re-prefill (paused sequences), with and without repack.
    "stream_preempting": dict(BASE, mode="stream", rollout_tp=1, max_num_seqs=1024, admit_kv_frac=1.0),
    "laminar_32b_preempting": dict(BASE, mode="laminar", model="qwen2.5-32b", rollout_tp=1, max_num_seqs=64,
                                   max_inflight_batches=4),
    # The CPU check's shared host (tiny model, calibration of the stored capture, fixed here).
    "cpu_sync": "sync",
    "cpu_one_step": "one_step",
    "cpu_laminar": "laminar",
}
CPU_PARAMS = dict(learner_mfu=0.1036, decode_overhead_s=0.00094, prefill_overhead_s=0.00094)
SKIP = ("mode", "model", "staleness_hist", "extra")


def _cpu_run(mode: str):
    import dataclasses

    from laminar_jax.sim import cpu_check
    from laminar_jax.sim.cost import CostParams

    rec = cpu_check.load_capture(os.path.join(os.path.dirname(__file__), "fixtures", "e2e_cpu_quick_loaded.jsonl"))
    params = dataclasses.replace(CostParams(), **cpu_check.CPU_FIXED, **CPU_PARAMS)
    return cpu_check._simulate(rec, mode, params, cpu_check.workload_for(rec))


def figures(name: str) -> dict:
    spec = RUNS[name]
    r = (_cpu_run(spec) if isinstance(spec, str) else simulate(SimSection(**spec))).to_dict()
    out = {k: v for k, v in r.items() if k not in SKIP}
    out["tokens_generated"] = r["extra"]["tokens_generated"]
    out["host_busy"] = r["extra"]["host_busy"]
    out["staleness_hist"] = r["staleness_hist"]
    return out


def _same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(a, float) or isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)
    return a == b


@pytest.mark.parametrize("name", sorted(RUNS))
def test_same_figures_as_stored(name):
    with open(FIXTURE) as f:
        want = json.load(f)[name]
    got = figures(name)
    diff = {k: (want[k], got.get(k)) for k in want if not _same(want[k], got.get(k))}
    assert not diff, f"{name}: figures changed (want, got): {diff}"


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit(__doc__)
    with open(FIXTURE, "w") as f:
        json.dump({name: figures(name) for name in RUNS}, f, indent=1, sort_keys=True)
        f.write("\n")
    print(f"wrote {FIXTURE}")
