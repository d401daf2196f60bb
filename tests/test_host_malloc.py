"""runtime.host_malloc: with 'keep' (set by the entry point's process settings, or through glibc's
environment variables for a child process), a computation that allocates a large temporary and a
large output on every call stops faulting fresh pages in; with 'system' every call faults them in
again. The computations run on the main thread (cpu_async_dispatch=False), whose arena can grow
without bound: another thread's arena maps a block above its 64 MB heaps directly, whatever the
policy (host_malloc.py). An unknown policy is an error naming the key."""

import subprocess
import sys

import pytest

from laminar_jax.cpu import host_malloc
from laminar_jax.config import ConfigError, default_config, finalize
from tests.subprocess_env import child_env

_PROG = r"""
import resource, sys
from laminar_jax.config import default_config, finalize
from laminar_jax.process_settings import apply_process_settings
c = default_config()
c.runtime.host_malloc = "system" if sys.argv[1] == "env" else sys.argv[1]  # env: the caller set glibc's variables
c.runtime.compilation_cache_dir = ""
c.runtime.cpu_threads, c.runtime.cpu_async_dispatch = 1, False  # computations run on this (the main) thread
apply_process_settings(finalize(c))
import jax, jax.numpy as jnp
# 48 MB per call, above glibc's largest mmap threshold: a temporary (the sorted rows) and an output.
x = jnp.ones((48 << 20) // 4, jnp.float32)
temporary = jax.jit(lambda x: jnp.sum(jnp.sort(x.reshape(-1, 256) * 2.0, axis=1)[:, ::3]))
output = jax.jit(lambda x: x * 2.0)
for name, f in (("TEMPORARY", temporary), ("OUTPUT", output)):
    for _ in range(3):
        f(x).block_until_ready()
    faults = []  # per call; the median, since the heaps may still grow once while they settle
    for _ in range(9):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        f(x).block_until_ready()
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    print(name, sorted(faults)[4])
"""

_PAGES = (48 << 20) // 4096  # pages of one output


def _faults_per_call(policy: str, **env: str) -> dict[str, float]:
    """{'TEMPORARY': median page faults per call, 'OUTPUT': ...} in a fresh process."""
    out = subprocess.run([sys.executable, "-c", _PROG, policy], capture_output=True, text=True, timeout=180,
                         env=child_env(JAX_PLATFORMS="cpu", **env))
    assert out.returncode == 0, out.stderr[-2000:]
    words = out.stdout.split()
    return {k: float(words[words.index(k) + 1]) for k in ("TEMPORARY", "OUTPUT")}


@pytest.fixture(scope="module")
def glibc():
    if host_malloc._glibc() is None:
        pytest.skip("runtime.host_malloc acts on glibc's allocator only")


def test_system_faults_every_output_in_and_keep_reuses_the_pages(glibc):
    system, keep = _faults_per_call("system"), _faults_per_call("keep")
    assert min(system.values()) > 0.8 * _PAGES, system
    assert max(keep.values()) < 0.05 * _PAGES, keep


def test_the_policy_as_environment_variables_holds_in_a_child_process(glibc):
    assert max(_faults_per_call("env", **host_malloc.environment("keep")).values()) < 0.05 * _PAGES


def test_an_unknown_policy_names_the_key():
    with pytest.raises(ValueError, match="runtime.host_malloc"):
        host_malloc.apply_host_malloc("tcmalloc")
    with pytest.raises(ValueError, match="runtime.host_malloc"):
        host_malloc.environment("tcmalloc")
    c = default_config()
    c.runtime.host_malloc = "tcmalloc"
    with pytest.raises(ConfigError, match="runtime.host_malloc"):
        finalize(c)


def test_system_sets_nothing():
    assert host_malloc.environment("system") == {}
    assert host_malloc.apply_host_malloc("system") is True
