"""Benchmarks: python launch/bench.py <name> [--quick] [options]   (python launch/bench.py <name> --help)

  learner   one learner step: tokens/s, MFU; --memory-plan (does a row fit), --attention-speed,
            --packing (the packed step's mini-batch draws and row buckets, side by side)
  engine    the paged-KV rollout engine vs a padded-batch and an HF baseline, long-tail workload
            (--preset qwen2-100m, --profile: a decode step broken down against the matmul peak)
  relay     weight publishing: learner stall, publish-to-visible latency, pull bandwidth, chain fan-out
  e2e       the same workload in every mode (sync, one_step, stream, laminar), side by side
  faults    the demo under a scripted chaos schedule (kill a rollout server, the relay, the learner)
  sim       the simulated Laminar set-up (7B-72B on 64-1024 GPUs), every mode
  startup   compile time of a cold run vs a run that finds the persistent compilation cache
            (--depths 4,28: the learner step's and the engine's compile time at each depth)
  env       a trivial python tool call, sandboxed (bubblewrap) against unsandboxed: calls/s, p50/p99 (--sandbox)
  peers     vLLM's CPU build against this engine on one HF checkpoint and long-tail requests
  accel     the accelerator check (one GPU/TPU, < 8 min): decode vs the HBM roofline at 64 rows
            (0.5B, 1.5B), long-tail tok/s, learner MFU (1.5B) publishing and not, compile times,
            peak memory against the plan; --dry-run (what it would run), --tiny (all of it on CPU)
  aot       the engine's decode step (the seam's TPU Pallas kernel) compiled ahead of time for a TPU
            topology on this machine (needs libtpu: the tpu extra), its bytes (XLA's cost model, an
            HBM estimate) against weights + live KV
  memory    every shipped accelerator config, scaled down, on fake CPU devices: each device's
            measured peak bytes against the memory plan (--quick, --config; --tpu: TPU compiler figures;
            --device: one config at its real size on this machine's GPU/TPU, memory_stats() peaks, and a
            short run of it; --device --dry-run: what that would run)

Each prints the machine (CPU model, cores, vector ISA, load average) first, then a table and, as its
last line, one JSON object with the figures and the same machine description under "machine".

  --host-malloc {keep,system}   (anywhere in the arguments) this process's C allocator policy, as
                                runtime.host_malloc sets it for a run; default: that key's default
"""

import importlib
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

NAMES = ("learner", "engine", "relay", "e2e", "faults", "sim", "startup", "peers", "env", "accel", "aot", "memory")


def _host_malloc(argv):
    """(policy, argv without it): the --host-malloc option, else runtime.host_malloc's default."""
    from laminar_jax.runtime.config import RuntimeSection

    policy, rest, it = RuntimeSection().host_malloc, [], iter(argv)
    for a in it:
        if a == "--host-malloc":
            policy = next(it, "")
        elif a.startswith("--host-malloc="):
            policy = a.split("=", 1)[1]
        else:
            rest.append(a)
    return policy, rest


def main(argv):
    policy, argv = _host_malloc(argv)
    if argv and argv[0] in ("-h", "--help", "help"):
        print(__doc__.strip())
        return 0
    if not argv or argv[0] not in NAMES:
        print(__doc__.strip(), file=sys.stderr)
        print(f"\nerror: expected one of {', '.join(NAMES)}, got {argv[0] if argv else 'nothing'}", file=sys.stderr)
        return 2
    from laminar_jax.benchmarks.machine import describe, summary_line
    from laminar_jax.cpu.host_malloc import apply_host_malloc

    try:
        held = apply_host_malloc(policy)  # before anything allocates XLA buffers (host_malloc.py)
    except ValueError as e:
        print(f"error: --host-malloc: {e}", file=sys.stderr)
        return 2
    print(summary_line(describe()) + f"; host malloc {policy}{'' if held else ' (not applied)'}", flush=True)  # figures compare only across the same CPU (machine.py)
    mod = importlib.import_module(f"laminar_jax.benchmarks.{argv[0]}")
    mod.main(argv[1:])  # prints its table, then its JSON line last
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
