"""A minimal learner loop: pull trajectory lists, step, publish, checkpoint (the buffer comes later)."""

from __future__ import annotations

from typing import Callable, Iterator, Optional, Sequence

from laminar_jax.learner.publish import Publisher
from laminar_jax.types import Trajectory


def run_learner(learner, batch_source: Iterator[Sequence[Trajectory]], steps: int,
                publisher: Optional[Publisher] = None, checkpoint_every: int = 0,
                extra_fn: Optional[Callable[[], dict]] = None,
                on_metrics: Optional[Callable[[dict], None]] = None) -> list[dict]:
    """Run up to `steps` learner steps (fewer if `batch_source` runs out); returns per-step metrics.

    After every `checkpoint_every` steps (0 = never) saves a checkpoint at step = learner.version
    with `extra_fn()` as its extra state (e.g. the data iterator position). Waits for the last
    publish and save before returning.
    """
    if publisher is not None:
        learner.publisher = publisher
    history = []
    for _ in range(steps):
        try:
            trajectories = next(batch_source)
        except StopIteration:
            break
        metrics = learner.step(trajectories)
        history.append(metrics)
        if on_metrics is not None:
            on_metrics(metrics)
        if checkpoint_every and learner.version % checkpoint_every == 0:
            learner.save(learner.version, extra_fn() if extra_fn is not None else {})
    learner.flush()
    return history
