"""Test-wide setup: the repo root on sys.path, JAX on CPU (JAX_PLATFORMS overrides), float32 matrix
products in float32, and one persistent compilation cache for the session.

Many tests build the demo's learner and engines afresh, so the same programs were compiled again and
again; a cache in a temporary directory (empty at the start of every session, removed at its end)
loads them instead. Tests that count compiles count cache loads as well (tests/compile_events.py).
Child processes inherit it through JAX's environment variables.

The tests run in parallel processes (pytest-xdist, `-n auto --dist loadfile` in pyproject.toml): one
per core, at most 4 (``pytest_xdist_auto_num_workers``), each test file on one worker so that its
module fixtures run once. Much of a test's time is single-threaded (XLA compiles, child processes
starting, waits on timeouts), so two workers on 2 cores took the tier from 30 to 20 minutes. The
workers share the controller's compilation cache (``_SHARED_CACHE``): it is made once, before they
start, and removed by the controller alone.
"""

import os
import shutil
import sys
import tempfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# float32 products in float32 on every backend, as runs do by default (laminar_jax/matmul_precision.py):
# the tests' float32 tolerances assume it, and a GPU or TPU would otherwise round the operands.
os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")

_CACHE_DIR = None  # the cache this process made, and removes at its end
_SHARED_CACHE = "LAMINAR_TEST_SHARED_CACHE_DIR"  # set by the controller for its xdist workers


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: absent without it
def pytest_xdist_auto_num_workers(config):
    # More workers than 4 buy little (the long tests are few) and cost each one's imports in memory.
    return max(1, min(4, len(os.sched_getaffinity(0))))


def pytest_configure(config):
    global _CACHE_DIR
    if os.environ.get("LAMINAR_TEST_COMPILATION_CACHE", "1") == "0":
        return
    import jax

    shared = os.environ.get(_SHARED_CACHE) if os.environ.get("PYTEST_XDIST_WORKER") else None
    cache_dir = shared or tempfile.mkdtemp(prefix="laminar-test-jaxcache-")
    if shared is None:
        _CACHE_DIR = cache_dir
        os.environ[_SHARED_CACHE] = cache_dir  # workers start after this hook and inherit it
    # Programs compiled in well under 0.2 s are cheaper to compile than to write and read back.
    settings = {"jax_compilation_cache_dir": cache_dir, "jax_persistent_cache_min_compile_time_secs": 0.2,
                "jax_persistent_cache_min_entry_size_bytes": 0}
    for name, value in settings.items():
        jax.config.update(name, value)
        # Child processes (multi-device meshes, multi-process learners) read JAX's settings from the
        # environment; an entry point that sets runtime.compilation_cache_dir overrides it.
        os.environ[name.upper()] = str(value)


def pytest_unconfigure(config):
    if _CACHE_DIR is not None:
        shutil.rmtree(_CACHE_DIR, ignore_errors=True)
