"""Chaos run: the demo with a scripted schedule that kills a rollout server, the relay and the learner.

python launch/bench.py faults [--quick] [--steps 16] [--server-processes] [--set section.key=value]

With --server-processes the rollout servers are child processes (runtime.server_processes) and the
rollout kill is a SIGKILL of one of them, as a lost process would die.

Prints the failure log and, last, one JSON line with what was killed, how long each recovery took,
and whether any prompt was lost or trained on twice.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time

from laminar_jax.benchmarks.e2e import parse_override, set_config_key
from laminar_jax.benchmarks.machine import emit


def chaos_config(steps: int, run_dir: str):
    from laminar_jax.config import repo_config

    c = repo_config("demo", "short")
    c.runtime.total_steps = steps
    c.runtime.checkpoint_every = max(2, steps // 2)  # the learner crash lands between checkpoints: replay
    c.runtime.run_dir = run_dir
    c.runtime.wait_timeout_s = 120.0
    c.relay.local_handoff = False  # the relay is one of the parts killed: servers pull through it
    return c


def schedule(steps: int) -> dict[int, str]:
    """Learner version after which each component is killed: early, middle, late."""
    return {max(1, steps // 4): "rollout", max(2, steps // 2): "relay", max(3, (3 * steps) // 4): "learner"}


def main(argv: list[str]) -> dict:
    ap = argparse.ArgumentParser(prog="bench.py faults")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--server-processes", action="store_true", help="rollout servers as child processes")
    ap.add_argument("--set", type=parse_override, action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="a config override applied after the chaos run's own (repeatable)")
    args = ap.parse_args(argv)
    steps = args.steps or (8 if args.quick else 16)
    out = args.out or tempfile.mkdtemp(prefix="laminar_faults_")

    from laminar_jax.config import finalize
    from laminar_jax.runtime.local import LocalRun

    c = chaos_config(steps, os.path.join(out, "run"))
    c.runtime.server_processes = args.server_processes
    for key, value in args.set:
        set_config_key(c, key, value)
    cfg = finalize(c)
    run = LocalRun(cfg, cfg.runtime.run_dir)
    plan = schedule(steps)
    kill_server = run.fleet.kill if args.server_processes else run.fleet.inject_crash
    actions = {"rollout": lambda: kill_server(0), "relay": run.inject_relay_failure,
               "learner": run.inject_learner_crash}
    killed = []
    relay_recovery = {}

    def watch_relay(v_kill: int, t_kill: float) -> None:
        # Recovered when every server runs a version published after the relay died (via the store).
        deadline = t_kill + cfg.runtime.wait_timeout_s
        while time.time() < deadline and not run.sup.stop.is_set():
            if min(run.buffer.stats()["board_versions"]) > v_kill:
                relay_recovery["relay"] = round(time.time() - t_kill, 3)
                return
            time.sleep(0.02)

    def await_server_recovery() -> None:
        # A replacement server process starts in seconds (a fresh interpreter, its engine, a pull):
        # before the last step, give it the time (bounded) so that a short run still measures it.
        deadline = time.time() + cfg.runtime.wait_timeout_s
        while time.time() < deadline and not run.sup.stop.is_set():
            if any("recovery_s" in f for f in run.failures if "server" in f):
                return
            time.sleep(0.05)

    def hook(version: int) -> None:
        if version == steps - 1 and "rollout" in killed:
            await_server_recovery()
        if version in plan:
            killed.append(plan[version])
            actions[plan[version]]()
            if plan[version] == "relay":
                threading.Thread(target=watch_relay, args=(version, time.time()), daemon=True).start()

    run.on_step_hooks.append(hook)
    t0 = time.time()
    summary = run.run()
    recovery = {}
    for f in summary["failures"]:
        kind = "rollout" if "server" in f else "learner" if "learner" in f else "relay"
        recovery[kind] = f.get("recovery_s", relay_recovery.get(kind))
        print(f"{kind:8s} at t={f['t']:6.2f}s  recovery_s={recovery[kind]}  "
              f"{ {k: v for k, v in f.items() if k not in ('t', 'recovery_s')} }")
    result = {"bench": "faults", "killed": killed, "lost_prompts": summary["lost_prompts"],
              "duplicated_prompts": summary["duplicated_prompts"], "recovery_s": recovery,
              "consumed_prompts": summary["consumed_prompts"],
              "expected_prompts": steps * cfg.runtime.prompts_per_step,
              "reward_last": summary["reward_last"], "steps": summary["steps"],
              "completed": summary["steps"] == steps and not summary["stopped_early"],
              "wall_s": round(time.time() - t0, 1), "overrides": dict(args.set)}
    return emit(result)


if __name__ == "__main__":
    main(sys.argv[1:])
