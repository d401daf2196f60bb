"""runtime.compilation_cache_dir: on by default under the user's cache dir, '' turns it off, and a
second process finds the first one's executables (a real cache hit, counted by JAX)."""

import subprocess
import sys

from laminar_jax.compile_cache import resolve_cache_dir
from laminar_jax.config import default_config, finalize
from tests.subprocess_env import child_env

_PROG = r"""
import sys, jax, jax.numpy as jnp, jax.monitoring
from laminar_jax.compile_cache import enable_compilation_cache
hits = []
jax.monitoring.register_event_listener(lambda e, **k: hits.append(e) if e.endswith("cache_hits") else None)
print("DIR", enable_compilation_cache(sys.argv[1]))
jax.jit(lambda x: jnp.tanh(x @ x.T).sum())(jnp.ones((64, 64))).block_until_ready()
print("HITS", len(hits))
"""


def _run(spec, home):
    env = child_env(JAX_PLATFORMS="cpu", HOME=str(home))
    env.pop("JAX_COMPILATION_CACHE_DIR", None)  # the test session's own cache (tests/conftest.py)
    out = subprocess.run([sys.executable, "-c", _PROG, spec], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines() if line[:4] in ("DIR ", "HITS"))
    return lines["DIR"], int(lines["HITS"])


def test_default_is_under_the_user_cache_dir_and_empty_is_off(tmp_path, monkeypatch):
    spec = finalize(default_config()).runtime.compilation_cache_dir
    monkeypatch.setenv("HOME", str(tmp_path))
    assert resolve_cache_dir(spec) == str(tmp_path / ".cache" / "laminar_jax" / "jax")
    assert resolve_cache_dir("") is None


def test_a_second_process_hits_the_cache(tmp_path):
    first_dir, first_hits = _run("~/jaxcache", tmp_path)
    assert first_dir == str(tmp_path / "jaxcache") and first_hits == 0
    assert any((tmp_path / "jaxcache").iterdir())
    _, second_hits = _run("~/jaxcache", tmp_path)
    assert second_hits >= 1
    off_dir, off_hits = _run("", tmp_path)
    assert off_dir == "None" and off_hits == 0
