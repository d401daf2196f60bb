"""XLA's CPU threads for this process: the intra-op pool's size (runtime.cpu_threads) and JAX's
asynchronous dispatch of CPU computations (runtime.cpu_async_dispatch), set before JAX starts.

XLA's CPU client sizes its one intra-op pool (the `tf_XLAEigen` threads) when the backend starts:
one thread per core, or `PJRT_NPROC` when that is set. JAX hands each CPU computation to it
asynchronously unless async dispatch is off, in which case the calling thread runs it (ops that
the executor finds independent may still go to the pool). At the CPU demo's shapes most ops take
microseconds, and handing them between threads costs CPU: one pool thread without async dispatch
spends less CPU per trained token, while the second pool thread buys tokens per second, so the
trade depends on the figure a run is for. The defaults are XLA's.

Entry points call `apply_cpu_threads()` once, before anything touches a JAX device.
"""

from __future__ import annotations

import logging
import os

_log = logging.getLogger(__name__)

ENV = "PJRT_NPROC"  # read by XLA's CPU client when it starts (xla/pjrt/cpu/cpu_client.cc)
_DISPATCH = "jax_cpu_enable_async_dispatch"  # read by JAX when it creates the CPU client


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

    dispatch_now = cpu_async_dispatch()
    if (n <= 0 or os.environ.get(ENV) == str(n)) and dispatch_now == async_dispatch:
        return True
    if _backend_started():
        _log.warning("runtime.cpu_threads=%d, runtime.cpu_async_dispatch=%s: JAX's CPU backend already started "
                     "in this process (%s=%r, async dispatch %s), which keeps them", n, async_dispatch, ENV,
                     os.environ.get(ENV), dispatch_now)
        return False
    if n > 0:
        os.environ[ENV] = str(n)
    jax.config.update(_DISPATCH, async_dispatch)
    return True


def cpu_async_dispatch() -> bool:
    """Whether JAX dispatches this process's CPU computations asynchronously (its current setting)."""
    import jax

    return bool(jax.config.values.get(_DISPATCH, True))


def xla_cpu_pool_threads() -> int:
    """How many XLA intra-op pool threads this process runs now (0 before the backend starts)."""
    try:
        names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
    except OSError:  # not Linux, or a thread exited while listing
        return 0
    return sum(1 for n in names if n.endswith("XLAEigen"))
