"""Hold the simulator against a real run: predict the CPU e2e bench's per-mode throughput.

  python -m laminar_jax.benchmarks.e2e_capture --out FILE  # run the e2e bench (--quick), keep its figures
  python -m laminar_jax.sim.cpu_check check FILE           # calibrate from FILE, simulate, compare

The capture (laminar_jax/benchmarks/e2e_capture.py) runs ``bench.py e2e --quick`` once and writes
one JSON line: the bench's own JSON line (``e2e``) plus, per mode, the run summary figures the
calibration needs (learner step time and tokens per step, generation rate) and the machine's load
average. The simulator only reads such files; it never runs a benchmark.

``check`` models that run: the tiny model on the ``cpu`` host preset, 1 learner + 4 rollout servers
of 8 slots, 8 prompts x 8 samples per step, the demo's scheduler settings, ``shared_host`` (every
plane shares the same cores), and a synthetic_skew workload whose mean trajectory length is the
sync run's. Calibrated from the same capture's *sync* run only: ``sim.calibrate`` turns its learner
step time into ``learner_mfu``, and one decode overhead is fitted so that simulated sync matches
measured sync (sync runs generation and training one after the other, so each is seen alone). Every
other mode is then a prediction, compared with its measured throughput.

The host is shared with other jobs, so the CPU a mode's run actually had differs from sync's. The
capture records each run's ``cpu_cores_busy`` (process CPU seconds per second of RL): the CPU it
*used*. The CPU it *had* is that over the fraction of the time the host had work, which the model
gives (``host_busy``: sync leaves the host idle between a step and the next batch, the overlapped
modes hardly ever), so each mode's costs are scaled by (sync's cores / sync's host_busy) / (its
cores / its host_busy): the simulated host is as fast as the one that run had.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys

import numpy as np

TOLERANCE = 0.25
# Fixed CPU costs (not fitted): a learner step has no separate overhead beyond its measured time, a
# weight swap on the host is a reference change plus a host copy, rewards are scored on a thread.
CPU_FIXED = {"learner_step_overhead_s": 1e-4, "load_overhead_s": 0.005}


def load_capture(path: str) -> dict:
    from laminar_jax.sim.calibrate import read_records

    recs = [r for r in read_records([path]) if r.get("bench") == "e2e_capture"]
    if not recs:
        raise ValueError(f"{path}: no e2e_capture record (written by: python -m laminar_jax.benchmarks.e2e_capture)")
    for mode in ("sync",):
        if mode not in recs[-1]["modes"]:
            raise ValueError(f"{path}: the capture has no {mode!r} run (the calibration needs it)")
    return recs[-1]


def _step_figures(m: dict, run: dict, k: int) -> tuple[float, float]:
    """(learner step s, tokens per trajectory) of one captured mode."""
    steps = m["steps_this_run"]
    step_s = m["learner_busy_frac"] * m["rl_wall_s"] / steps
    tokens = m["train_tokens_per_s"] * m["rl_wall_s"] / steps / (run["prompts_per_step"] * k)
    return step_s, tokens


def workload_for(rec: dict):
    """synthetic_skew (repeat count log-normal, sigma 1 -> p99/median 10; a prompt fixes its
    samples' target length), its response median set so the mean trajectory length is the sync run's."""
    from laminar_jax.sim.workload import WorkloadSpec, sample

    k = rec["samples_per_prompt"]
    _, mean_tokens = _step_figures(rec["modes"]["sync"], rec["modes"]["sync"]["run"], k)
    spec = WorkloadSpec("synthetic_skew", response_median=5.0, p99_over_median=10.0, max_response=129,
                        prompt_median=6.0, prompt_sigma=0.15, max_prompt=32, group_corr=0.9, reward_latency_s=0.0)
    rng = np.random.default_rng(0)
    for _ in range(4):  # the clip makes the mean slightly sub-linear in the median
        d = sample(spec, 4000, k, rng)
        mean = float((d.prompt_len + d.response_len).mean())
        spec = dataclasses.replace(spec, response_median=spec.response_median * (mean_tokens - 6.0) / (mean - 6.0))
    return spec


def section_for(rec: dict, mode: str, duration_s: float = 20.0):
    from laminar_jax.sim import SimSection

    run = rec["modes"][mode]["run"]
    return SimSection(model="tiny", gpu="cpu", gpus=1 + run["servers"], learner_gpus=1, rollout_tp=1,
                      mode="laminar" if mode.startswith("laminar") else mode, repack=mode != "laminar_norepack",
                      prompts_per_step=run["prompts_per_step"], samples_per_prompt=rec["samples_per_prompt"],
                      max_num_seqs=run["slots"], max_staleness=1, admit_lag=rec["admit_lag"],
                      max_inflight_batches=rec["max_inflight_batches"], max_batch=16, repack_interval_s=0.1,
                      tick_s=0.01, duration_s=duration_s + 2.0, warmup_s=2.0, max_duration_s=duration_s + 60.0,
                      shared_host=True)


def _simulate(rec: dict, mode: str, params, work):
    from laminar_jax.sim.api import cost_model, placement
    from laminar_jax.sim.engine import Simulator

    cfg = section_for(rec, mode)
    cfg.validate("sim")
    cost = cost_model(cfg, params)
    return Simulator(cfg, cost, work, placement(cfg, cost)).run()


def calibrate(rec: dict, path: str):
    """CostParams for the capture: learner_mfu via sim.calibrate, then the decode overhead fitted on sync."""
    from laminar_jax.sim.calibrate import fit
    from laminar_jax.sim.cost import CostParams

    fitted = fit([path], "tiny", "cpu", 1)["params"]
    base = dataclasses.replace(CostParams(), **CPU_FIXED, **fitted)
    work = workload_for(rec)
    target = rec["modes"]["sync"]["train_tokens_per_s"]
    lo, hi = math.log(1e-4), math.log(0.05)  # sync throughput falls as the overhead grows
    for _ in range(8):
        mid = (lo + hi) / 2
        p = dataclasses.replace(base, decode_overhead_s=math.exp(mid), prefill_overhead_s=math.exp(mid))
        if _simulate(rec, "sync", p, work).tokens_per_s > target:
            lo = mid
        else:
            hi = mid
    ovh = math.exp((lo + hi) / 2)
    return dataclasses.replace(base, decode_overhead_s=ovh, prefill_overhead_s=ovh), work


def host_share(rec: dict, mode: str, busy: float = 1.0, sync_busy: float = 1.0) -> float:
    """CPU the mode's run had relative to the sync run (1.0 when the capture lacks the figure).

    A run's ``cpu_cores_busy`` is the CPU it used; the CPU it had is that over the fraction of the
    time the host had work, ``busy`` (the model's ``host_busy`` for that run)."""
    sync, m = rec["modes"]["sync"].get("cpu_cores_busy"), rec["modes"][mode].get("cpu_cores_busy")
    return (m / busy) / (sync / sync_busy) if sync and m else 1.0


def scaled(params, share: float):
    """Cost parameters of a host ``share`` times as fast (every CPU cost divided by it)."""
    return dataclasses.replace(params, decode_overhead_s=params.decode_overhead_s / share,
                               prefill_overhead_s=params.prefill_overhead_s / share,
                               learner_mfu=params.learner_mfu * share)


def predict(rec: dict, mode: str, params, work, sync_busy: float, rounds: int = 2):
    """(SimResult, host share) of one mode: its host's speed from its ``cpu_cores_busy`` over the
    model's own ``host_busy`` for it, found by iterating from a fully busy host."""
    busy = sync_busy if mode == "sync" else 1.0
    for _ in range(rounds):
        share = host_share(rec, mode, busy, sync_busy)
        r = _simulate(rec, mode, scaled(params, share), work)
        busy = r.extra["host_busy"]
    return r, share


def check(path: str, tolerance: float = TOLERANCE) -> dict:
    """Predicted vs measured train tokens/s per captured mode; 'ok' when within tolerance."""
    rec = load_capture(path)
    params, work = calibrate(rec, path)
    sync_busy = _simulate(rec, "sync", params, work).extra["host_busy"]
    rows = {}
    for mode, m in rec["modes"].items():
        r, share = predict(rec, mode, params, work, sync_busy, rounds=1 if mode == "sync" else 2)
        ratio = r.tokens_per_s / m["train_tokens_per_s"]
        rows[mode] = {"measured_tps": m["train_tokens_per_s"], "predicted_tps": round(r.tokens_per_s, 1),
                      "ratio": round(ratio, 3), "fitted_on": mode == "sync", "host_share": round(share, 3),
                      "predicted_host_busy": round(r.extra["host_busy"], 3),
                      "measured_staleness": m["mean_staleness"], "predicted_staleness": round(r.mean_staleness, 2),
                      "measured_learner_busy": m["learner_busy_frac"],
                      "predicted_learner_busy": round(1 - r.learner_idle, 3),
                      "measured_slot_util": m["slot_util"], "predicted_slot_util": round(r.slot_util, 3),
                      "measured_learner_step_s": round(_step_figures(m, m["run"], rec["samples_per_prompt"])[0], 4),
                      "predicted_learner_step_s": round(r.step_s * (1 - r.learner_idle), 4)}
    ok = all(abs(x["ratio"] - 1) <= tolerance for x in rows.values())
    return {"bench": "sim_cpu_check", "source": path, "tolerance": tolerance, "ok": ok, "modes": rows,
            "params": {"learner_mfu": params.learner_mfu, "decode_overhead_s": params.decode_overhead_s},
            "response_median": work.response_median, "capture_loadavg": rec.get("loadavg_after")}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    k = sub.add_parser("check")
    k.add_argument("file")
    k.add_argument("--tolerance", type=float, default=TOLERANCE)
    args = ap.parse_args(argv)
    res = check(args.file, args.tolerance)
    print(f"{'mode':10s} {'measured':>9s} {'predicted':>9s} {'ratio':>6s}  staleness  learner step s  learner busy"
          "  slot util  (measured/predicted)  host share")
    for mode, x in res["modes"].items():
        print(f"{mode:10s} {x['measured_tps']:9.0f} {x['predicted_tps']:9.0f} {x['ratio']:6.2f}  "
              f"{x['measured_staleness']:.2f}/{x['predicted_staleness']:.2f}  "
              f"{x['measured_learner_step_s']:.3f}/{x['predicted_learner_step_s']:.3f}  "
              f"{x['measured_learner_busy']:.2f}/{x['predicted_learner_busy']:.2f}  "
              f"{x['measured_slot_util']:.2f}/{x['predicted_slot_util']:.2f}  {x['host_share']:.3f}"
              f"{'  (fitted)' if x['fitted_on'] else ''}")
    print(json.dumps(res))
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
