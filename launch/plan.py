"""Placement planner: per mode, the highest-throughput learner/rollout split whose staleness stays
within the target (sim.max_mean_staleness, sim.max_p99_staleness), by simulation.

  python launch/plan.py --model qwen2.5-7b --gpus 256 --gpu h800 --mode laminar
  python launch/plan.py --config=laminar_jax/sim/example_config.py
      (a python file whose get_config() returns a ConfigDict of laminar_jax.sim.SimSection; see docs/CONFIG.md)

Per-device memory of a run config's placement against an accelerator (h100, h200, tpu-v5e):

  python launch/plan.py memory --config=configs/gpu_node.py --gpu h100
  python launch/plan.py memory --config=configs/gpu_node.py:32b --gpu h200 --devices 8 --json
  python launch/plan.py memory --table      (every shipped accelerator config: the table in docs/DEPLOY.md)
      (exit status 0 when it fits, 1 when a device does not; see laminar_jax/placement_memory.py)
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from laminar_jax.cli import load_config_module  # noqa: E402
from laminar_jax.configlib import ConfigError  # noqa: E402
from laminar_jax.sim import GPUS, default_sim_config, finalize_sim  # noqa: E402
from laminar_jax.sim.hardware import model_names  # noqa: E402
from laminar_jax.sim.workload import PRESETS as WORKLOADS  # noqa: E402
from laminar_jax.sim.planner import ALL_MODES, format_table, plan  # noqa: E402


def load_config(path):
    return load_config_module(path, variant=False).get_config()


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", help="python file with get_config() returning a sim ConfigDict")
    ap.add_argument("--model", choices=model_names(), metavar="MODEL",
                    help=f"model shape (default qwen2.5-7b): {', '.join(model_names())}")
    ap.add_argument("--gpus", type=int, help="total GPUs, learner + rollouts (default 64)")
    ap.add_argument("--gpu", choices=sorted(GPUS), help="GPU preset (default h800)")
    ap.add_argument("--workload", choices=sorted(WORKLOADS), help="workload preset (default math)")
    ap.add_argument("--calibration", help="JSON file written by python -m laminar_jax.sim.calibrate")
    ap.add_argument("--max-mean-staleness", type=float, help="staleness target: mean (default 2)")
    ap.add_argument("--max-p99-staleness", type=float, help="staleness target: 99th percentile (default 6)")
    ap.add_argument("--mode", action="append", choices=ALL_MODES, help="repeatable; default: every mode")
    ap.add_argument("--points", type=int, default=5, help="coarse grid points per TP")
    ap.add_argument("--duration", type=float, default=1800.0, help="simulated seconds per candidate")
    ap.add_argument("--no-tp-search", action="store_true")
    args = ap.parse_args(argv)
    cd = load_config(args.config) if args.config else default_sim_config()
    for key in ("model", "gpus", "gpu", "workload", "calibration", "max_mean_staleness", "max_p99_staleness"):
        if getattr(args, key) is not None:
            cd[key] = getattr(args, key)
    if not args.config:
        cd.duration_s, cd.warmup_s, cd.min_steps = args.duration, min(300.0, args.duration / 4), 3
    base = finalize_sim(cd)
    rows = plan(base, args.mode or ALL_MODES, points=args.points, search_tp=not args.no_tp_search,
                progress=lambda s: print("  " + s, flush=True))
    print(f"\n{base.model} on {base.gpus} x {base.gpu}, workload {base.workload}:")
    print(format_table(rows))
    return 0


def memory_main(argv):
    """`plan.py memory`: per-device bytes of a run config (configs/<x>.py[:variant]) on a host of accelerators."""
    import json

    from laminar_jax.config import finalize
    from laminar_jax.placement_memory import ACCELERATORS, format_report, report

    ap = argparse.ArgumentParser(prog="plan.py memory", description=memory_main.__doc__)
    ap.add_argument("--config", help="run config file[:variant], e.g. configs/gpu_node.py:32b")
    ap.add_argument("--table", action="store_true",
                    help="every shipped accelerator config on the accelerator it is sized for, as the markdown "
                         "table in docs/DEPLOY.md (exit 1 when one does not fit)")
    ap.add_argument("--gpu", default="h100", choices=sorted(ACCELERATORS), help="accelerator (default h100)")
    ap.add_argument("--devices", type=int, default=8, help="accelerators on the host (default 8)")
    ap.add_argument("--json", action="store_true", help="print the report as one JSON line")
    args = ap.parse_args(argv)
    if args.table:
        from laminar_jax.placement_memory import shipped_table

        table = shipped_table()
        print(table)
        return 0 if "DOES NOT FIT" not in table else 1
    if not args.config:
        ap.error("--config is required (or --table)")
    mod = load_config_module(args.config)
    r = report(finalize(mod.get_config(args.config.partition(":")[2])), args.gpu, args.devices)
    print(json.dumps(r) if args.json else format_report(r))
    return 0 if r["fits"] else 1


if __name__ == "__main__":
    try:
        sys.exit(memory_main(sys.argv[2:]) if sys.argv[1:2] == ["memory"] else main(sys.argv[1:]))
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        sys.exit(2)
