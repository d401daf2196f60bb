"""Hold the simulator against a real run: predict the CPU e2e bench's per-mode throughput.

  python -m laminar_jax.sim.cpu_check capture --out FILE   # run the e2e bench (--quick), keep its figures
  python -m laminar_jax.sim.cpu_check check FILE           # calibrate from FILE, simulate, compare

``capture`` runs ``bench.py e2e --quick`` once and writes one JSON line: the bench's own JSON line
(``e2e``) plus, per mode, the run summary figures the calibration needs (learner step time and
tokens per step, generation rate) and the machine's load average.
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
        s = run_mode(mode, model_dir, budget_s, run_root, args)
        summaries[mode] = {k: s.get(k) for k in _KEEP}
        summaries[mode]["run"] = {"servers": args.servers, "slots": args.slots,
                                  "prompts_per_step": args.prompts_per_step}
        return s

    e2e.run_mode = keep
    try:
        load0 = os.getloadavg()
        res = e2e.main(["--quick", "--modes", ",".join(modes), "--out", tempfile.mkdtemp(prefix="sim_cpu_check_")])
    finally:
        e2e.run_mode = run_mode
    from laminar_jax.config import finalize, repo_config

    demo = finalize(repo_config("demo"))
    rec = {"bench": "e2e_capture", "command": "python -m laminar_jax.sim.cpu_check capture --out FILE",
           "e2e": res, "modes": summaries, "loadavg_before": load0, "loadavg_after": os.getloadavg(),
           "samples_per_prompt": demo.runtime.samples_per_prompt, "admit_lag": demo.scheduler.admit_lag,
           "max_inflight_batches": demo.runtime.max_inflight_batches}
    with open(out, "w") as f:
        f.write(json.dumps(rec) + "\n")
    return rec


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("capture")
    c.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if args.cmd == "capture":
        capture(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
