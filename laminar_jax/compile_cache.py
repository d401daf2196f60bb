"""JAX's persistent compilation cache, on by default (runtime.compilation_cache_dir).

Compiling the learner step, the rollout engine's buckets and the SFT step takes most of a short
run's start-up; with the cache a second run with the same shapes loads the executables instead.
Entry points call enable_compilation_cache() once, before anything is compiled.
"""

from __future__ import annotations

import logging
import os
from typing import Optional

_log = logging.getLogger(__name__)

# JAX's monitoring events, one per program that was not in memory: an XLA compile, or a load from
# the persistent cache (no compile event then). What "compiled after warm-up" counts.
COMPILE_EVENTS = ("/jax/core/compile/backend_compile_duration", "/jax/compilation_cache/cache_retrieval_time_sec")


def resolve_cache_dir(spec: Optional[str]) -> Optional[str]:
    """'' or None: off; otherwise the path with ~ and $VARS expanded, made absolute."""
    if not spec:
        return None
    return os.path.abspath(os.path.expandvars(os.path.expanduser(spec)))


def enable_compilation_cache(spec: Optional[str], min_compile_time_s: float = 0.0) -> Optional[str]:
    """Point JAX's persistent cache at `spec` (created if missing); returns the directory or None (off).

    min_compile_time_s=0 caches every executable: a CPU run compiles many programs of well under
    JAX's default threshold of 1 s, and together they are most of its start-up.
    """
    import jax

    path = resolve_cache_dir(spec)
    if path is None:
        return None
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:  # a read-only home must not stop a run: compile as before
        _log.warning("runtime.compilation_cache_dir=%r: cannot create it (%s); compilation cache off", spec, e)
        return None
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_time_s))
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path
