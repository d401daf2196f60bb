"""runtime.cpu_threads / cpu_async_dispatch: XLA's CPU pool gets the asked size when it is set before
JAX starts (counted from the process's own threads); without async dispatch a computation's CPU is
spent on its calling thread; a started backend keeps its settings (with a warning); a negative size
is a config error naming the key."""

import os
import subprocess
import sys

import pytest

from laminar_jax.config import ConfigError, default_config, finalize
from tests.subprocess_env import child_env

_PROG = r"""
import logging, sys
logging.basicConfig(level="WARNING")
from laminar_jax.cpu.threads import apply_cpu_threads, xla_cpu_pool_threads
import time
before, late, async_dispatch = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "async"
held = apply_cpu_threads(before, async_dispatch)
import jax, jax.numpy as jnp
f = jax.jit(lambda x: jnp.tanh(x @ x.T).sum())
x = jnp.ones((384, 384))
f(x).block_until_ready()
t0, p0 = time.thread_time(), time.process_time()
for _ in range(40):
    f(x).block_until_ready()
caller = (time.thread_time() - t0) / max(time.process_time() - p0, 1e-9)
print("HELD", held, "POOL", xla_cpu_pool_threads(), "LATE", apply_cpu_threads(late) if late else None)
print("CALLER_SHARE", round(caller, 3))
print("POOL_AFTER", xla_cpu_pool_threads())
"""


def _run(before: int, late: int = 0, dispatch: str = "async") -> tuple[dict, str]:
    env = child_env(JAX_PLATFORMS="cpu")
    env.pop("PJRT_NPROC", None)
    out = subprocess.run([sys.executable, "-c", _PROG, str(before), str(late), dispatch], capture_output=True,
                         text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    words = " ".join(out.stdout.split()).split(" ")
    return dict(zip(words[::2], words[1::2])), out.stderr


@pytest.mark.parametrize("n", [1, 2])
def test_the_pool_has_the_asked_size(n):
    got, _ = _run(n)
    assert got["HELD"] == "True" and got["POOL"] == str(n)


def test_without_async_dispatch_the_calling_thread_computes():
    inline, _ = _run(1, dispatch="inline")
    handed_off, _ = _run(1, dispatch="async")
    assert float(inline["CALLER_SHARE"]) > 0.6, inline
    assert float(handed_off["CALLER_SHARE"]) < 0.4, handed_off


def test_a_started_backend_keeps_its_pool_and_says_so():
    got, err = _run(1, late=3)
    assert got["LATE"] == "False" and got["POOL_AFTER"] == "1"
    assert "runtime.cpu_threads=3" in err and "already started" in err


def test_zero_keeps_xla_default_and_negative_is_refused():
    got, _ = _run(0)
    assert int(got["POOL"]) == len(os.sched_getaffinity(0))  # XLA's default: one per schedulable core
    c = default_config()
    c.runtime.cpu_threads = -1
    with pytest.raises(ConfigError, match="runtime.cpu_threads"):
        finalize(c)
