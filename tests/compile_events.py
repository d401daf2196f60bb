"""Counting XLA compiles in a test: JAX's compile events, collected while a block runs.

An executable loaded from the persistent compilation cache (tests/conftest.py turns one on) counts
too: either way the program was not in memory and the caller waited for XLA.
"""

import contextlib

from jax import monitoring

from laminar_jax.compile_cache import COMPILE_EVENTS


@contextlib.contextmanager
def count_compiles():
    """Yields a list that gains one entry per backend compile or cache load until the block exits."""
    compiles: list = []

    def listen(event, secs, **kw):
        if event in COMPILE_EVENTS:
            compiles.append(event)

    monitoring.register_event_duration_secs_listener(listen)
    try:
        yield compiles
    finally:
        unregister = getattr(monitoring, "_unregister_event_duration_listener_by_callback", None)
        if unregister is not None:
            unregister(listen)
