"""Subprocess side of the driver-death test: a Ray run (demo short, long enough not to end by
itself) that prints "ready" once its actors are up, then trains until it is killed.

argv: run_dir [ray address]  (no address: the run starts, and owns, a local cluster)
"""

import sys

from laminar_jax.config import finalize, repo_config


def main() -> None:
    from laminar_jax.runtime.ray_runtime import RayRun

    c = repo_config("demo", "short")
    c.runtime.kind = "ray"
    c.runtime.num_servers = 2
    c.runtime.run_dir = sys.argv[1]
    c.runtime.total_steps = 10_000
    c.runtime.sft_warmup_steps = 0
    c.learner.compile_ahead = "none"  # shapes compile at first use: not a warm-up test (test_learner_warmup.py is)
    if len(sys.argv) > 2:
        c.runtime.address = sys.argv[2]
    run = RayRun(finalize(c), c.runtime.run_dir)
    print("ready", flush=True)
    run.run()


if __name__ == "__main__":
    sys.exit(main())
