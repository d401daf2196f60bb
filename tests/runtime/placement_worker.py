"""The CPU demo (short) on a fake 8-device host under a placement; prints one JSON line of results.

argv: learner_devices rollout_tp colocate run_dir. Run with
XLA_FLAGS=--xla_force_host_platform_device_count=8 (tests/runtime/test_placement_runtime.py does).
"""

import json
import sys

import jax

from laminar_jax.config import finalize, repo_config
from laminar_jax.runtime.local import LocalRun
from laminar_jax.runtime.parts import run_with


def devices_of(tree) -> list[int]:
    return sorted({d.id for x in jax.tree.leaves(tree) if isinstance(x, jax.Array) for d in x.sharding.device_set})


def roles(driver) -> dict:
    """Device ids holding the learner's state and each server's weights and decode state."""
    servers = [{"params": devices_of(w.server._params), "state": devices_of(w.server._state)}
               for w in driver.fleet.workers]
    return {"learner": devices_of(driver.learner.state), "servers": servers}


def main(learner_devices: str, tp: int, colocate: bool, run_dir: str) -> None:
    c = repo_config("demo", "short")
    c.runtime.run_dir = run_dir
    c.runtime.total_steps = 3
    c.runtime.timeline = False
    c.placement.learner_devices = None if learner_devices == "all" else int(learner_devices)
    c.placement.rollout_tp = tp
    c.placement.colocate = colocate
    seen = {}

    def build(cfg, run_dir, stop):
        driver = LocalRun(cfg, run_dir, stop)
        seen["before"] = roles(driver)
        run = driver.run

        def run_and_look():
            out = run()
            seen["after"] = roles(driver)
            return out
        driver.run = run_and_look
        return driver

    summary = run_with(build, finalize(c))
    with open(f"{run_dir}/config.json") as f:
        recorded = json.load(f).get("realised_placement")
    keys = ("steps", "lost_prompts", "duplicated_prompts", "consumed_prompts", "reward_first", "reward_last",
            "placement")
    print("RESULT " + json.dumps({"summary": {k: summary.get(k) for k in keys}, "roles": seen,
                                  "recorded": recorded}))


if __name__ == "__main__":
    assert jax.device_count() == 8, jax.device_count()
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3] == "true", sys.argv[4])
