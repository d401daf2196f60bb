"""XLA:CPU's intra-op thread pool size (runtime.cpu_threads), set before the CPU backend starts.

XLA's CPU client sizes its one intra-op pool (the `tf_XLAEigen` threads) when the backend starts:
one thread per core, or `PJRT_NPROC` when that is set. At the CPU demo's shapes most XLA ops take
microseconds, and a pool thread per core spends a good part of its CPU handing them around and
spinning for the next: a learner step of the demo's model took ~20% less CPU (and ~1.4x the wall)
with one pool thread. A run of several planes (learner, rollout servers) keeps the cores busy with
its own threads, so on a small CPU one pool thread can cost it little speed and save CPU per token
(docs/BENCHMARKS.md, "One XLA thread"). 0 keeps XLA's default.

JAX's asynchronous dispatch (runtime.cpu_async_dispatch) hands every CPU computation to another
thread; off, a computation runs on the thread that calls it, which costs less per call (and with
one pool thread lets the learner and each server compute side by side on their own threads).

Entry points call `apply_cpu_threads()` once, before anything touches a JAX device.
"""

from __future__ import annotations

import logging
import os

_log = logging.getLogger(__name__)

ENV = "PJRT_NPROC"  # read by XLA's CPU client when it starts (xla/pjrt/cpu/cpu_client.cc)


def _backend_started() -> bool:
    import sys

    if "jax" not in sys.modules:
        return False
    from jax._src import xla_bridge

    started = getattr(xla_bridge, "backends_are_initialized", None)
    return bool(started and started())


def apply_cpu_threads(n: int, async_dispatch: bool = True) -> bool:
    """Size XLA's CPU pool to `n` threads (0: leave XLA's default) and set JAX's async dispatch of CPU
    computations (False: each runs on the thread that calls it). True when the settings will hold;
    False (logged) when this process's backend already started, which keeps its pool and dispatch."""
    import jax

    dispatch_now = jax.config.values.get("jax_cpu_enable_async_dispatch", True)
    if (n <= 0 or os.environ.get(ENV) == str(n)) and dispatch_now == async_dispatch:
        return True
    if _backend_started():
        _log.warning("runtime.cpu_threads=%d, runtime.cpu_async_dispatch=%s: JAX's CPU backend already started "
                     "in this process (%s=%r, async dispatch %s), which keeps them", n, async_dispatch, ENV,
                     os.environ.get(ENV), dispatch_now)
        return False
    if n > 0:
        os.environ[ENV] = str(n)
    jax.config.update("jax_cpu_enable_async_dispatch", async_dispatch)
    return True


def xla_cpu_pool_threads() -> int:
    """How many XLA intra-op pool threads this process runs now (0 before the backend starts)."""
    try:
        names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
    except OSError:  # not Linux, or a thread exited while listing
        return 0
    return sum(1 for n in names if n.endswith("XLAEigen"))
