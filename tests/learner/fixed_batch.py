"""A fixed learner batch for tests: two GRPO groups of four 6-token responses over a 16-token vocab,
scored by their share of 7s (plus an optional per-sample bonus), so a step has a signal to follow."""

import numpy as np

from laminar_jax.types import Trajectory


def two_groups(version: int = 0, bonus_per_sample: float = 0.0) -> list[Trajectory]:
    rng = np.random.default_rng(0)
    out = []
    for g in range(2):
        for i in range(4):
            resp = rng.integers(3, 16, 6).astype(np.int32)
            out.append(Trajectory(f"{g}/{i}", f"p{g}", i, np.array([1, 3 + g], np.int32), resp,
                                  np.full(6, -2.0, np.float32), version,
                                  reward=float(np.mean(resp == 7) + i * bonus_per_sample)))
    return out
