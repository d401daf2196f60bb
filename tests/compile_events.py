"""Counting XLA compiles in a test: JAX's compile events, collected while a block runs."""

import contextlib

from jax import monitoring


@contextlib.contextmanager
def count_compiles():
    """Yields a list that gains one entry per backend compile until the block exits."""
    compiles: list = []

    def listen(event, secs, **kw):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    monitoring.register_event_duration_secs_listener(listen)
    try:
        yield compiles
    finally:
        unregister = getattr(monitoring, "_unregister_event_duration_listener_by_callback", None)
        if unregister is not None:
            unregister(listen)
