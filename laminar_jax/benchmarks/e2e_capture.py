"""Capture the CPU e2e bench for the simulator's check (laminar_jax/sim/cpu_check.py).

  python -m laminar_jax.benchmarks.e2e_capture --out FILE

Runs ``bench.py e2e --quick`` once in this process and writes one JSON line: the bench's own JSON
line (``e2e``) plus, per mode, the run summary figures the calibration needs (learner step time and
tokens per step, generation rate) and the machine's load average around each mode's run.
``python -m laminar_jax.sim.cpu_check check FILE`` then models that run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

CAPTURE_MODES = ("sync", "one_step", "stream", "laminar")
_KEEP = ("steps_this_run", "rl_wall_s", "train_tokens_per_s", "learner_busy_frac", "gen_tokens_per_s",
         "slot_util", "kv_util", "mean_staleness", "cpu_cores_busy", "consumed_prompts", "latency_p50_s",
         "latency_p99_s", "repack_moves")


def capture(out: str, modes=CAPTURE_MODES) -> dict:
    """Run the e2e bench (--quick) in this process and write its figures as one JSON line to ``out``."""
    from laminar_jax.benchmarks import e2e

    summaries = {}
    run_mode = e2e.run_mode

    def keep(mode, model_dir, budget_s, run_root, args):
        load_before = os.getloadavg()
        s = run_mode(mode, model_dir, budget_s, run_root, args)
        summaries[mode] = {k: s.get(k) for k in _KEEP}
        # The host's load around each mode's run: the modes run one after another, and a load that
        # rises during the capture slows the later ones in ways cpu_cores_busy does not show.
        summaries[mode]["loadavg"] = [load_before, os.getloadavg()]
        summaries[mode]["run"] = {"servers": args.servers, "slots": args.slots,
                                  "prompts_per_step": args.prompts_per_step}
        return s

    e2e.run_mode = keep
    try:
        load0 = os.getloadavg()
        res = e2e.main(["--quick", "--modes", ",".join(modes), "--out", tempfile.mkdtemp(prefix="e2e_capture_")])
    finally:
        e2e.run_mode = run_mode
    from laminar_jax.config import finalize, repo_config

    demo = finalize(repo_config("demo"))
    rec = {"bench": "e2e_capture", "command": "python -m laminar_jax.benchmarks.e2e_capture --out FILE",
           "e2e": res, "modes": summaries, "loadavg_before": load0, "loadavg_after": os.getloadavg(),
           "host_cpus": os.cpu_count(), "samples_per_prompt": demo.runtime.samples_per_prompt,
           "admit_lag": demo.scheduler.admit_lag,
           "max_inflight_batches": demo.runtime.max_inflight_batches}
    with open(out, "w") as f:
        f.write(json.dumps(rec) + "\n")
    return rec


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="the JSON-lines file to write")
    ap.add_argument("--modes", default=",".join(CAPTURE_MODES), help="comma-separated modes to run")
    args = ap.parse_args(argv)
    capture(args.out, tuple(m for m in args.modes.split(",") if m))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
