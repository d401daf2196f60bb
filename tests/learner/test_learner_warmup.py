"""Learner.warmup: every bucket's programs are compiled ahead, so the steps after it compile nothing
(or, with learner.compile_ahead="none", none ahead: each shape at its first step)."""

import numpy as np
from flax import nnx

from laminar_jax.learner import Learner, LearnerSection
from laminar_jax.model import PRESETS, Transformer
from laminar_jax.types import Trajectory
from tests.compile_events import count_compiles


def _batch(seed: int, length: int, n: int = 8, group: int = 4):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        r = rng.integers(3, 100, length)
        out.append(Trajectory(f"s{seed}p{i // group}/{i % group}", f"s{seed}p{i // group}", i % group,
                              np.array([1, 5, 6]), r, rng.normal(-4.8, 0.3, length).astype(np.float32), 0,
                              reward=float(rng.random())))
    return out


def test_warmup_compiles_every_bucket_ahead():
    section = LearnerSection(lr=1e-3, adv_estimator="grpo", mini_batches=2, seq_len_buckets=(16, 32, 64))
    learner = Learner(section, Transformer(PRESETS["tiny"], rngs=nnx.Rngs(0)))
    with count_compiles() as compiles:
        _check(learner, compiles)


def _check(learner, compiles):
    assert learner.warmup(8, max_tokens=32) == 2  # buckets 16 and 32
    warm = len(compiles)
    assert warm >= 4  # prepare + train step (+ select) per bucket
    before = len(compiles)
    learner.step(_batch(0, 5))  # 8 tokens -> bucket 16
    learner.step(_batch(1, 20))  # 23 tokens -> bucket 32
    assert len(compiles) == before, f"steps after warmup compiled {len(compiles) - before} programs"
    learner.step(_batch(2, 50))  # 53 tokens -> bucket 64, not warmed: compiles (the check can fail)
    assert len(compiles) > before


def test_compile_ahead_none_compiles_each_shape_at_its_first_step_and_trains_the_same():
    base = dict(lr=1e-3, adv_estimator="grpo", mini_batches=2, seq_len_buckets=(16, 32, 64))
    ahead = Learner(LearnerSection(**base), Transformer(PRESETS["tiny"], rngs=nnx.Rngs(0)))
    lazy = Learner(LearnerSection(**base, compile_ahead="none"), Transformer(PRESETS["tiny"], rngs=nnx.Rngs(0)))
    assert lazy.batch_shapes(8, max_tokens=32) == ahead.batch_shapes(8, max_tokens=32) == [(8, 16), (8, 32)]
    ahead.warmup(8, max_tokens=32)
    with count_compiles() as compiles:
        assert lazy.warmup(8, max_tokens=32) == 0
        assert not compiles, f"warm-up compiled {len(compiles)} programs with compile_ahead='none'"
        first = lazy.step(_batch(0, 5))  # bucket 16: its first step compiles it
        after_first = len(compiles)
        assert after_first > 0
        second = lazy.step(_batch(1, 6))  # bucket 16 again: nothing to compile
        assert len(compiles) == after_first, f"a shape's second step compiled {len(compiles) - after_first}"
    for got, want in ((first, ahead.step(_batch(0, 5))), (second, ahead.step(_batch(1, 6)))):
        for k in ("loss", "pg_loss", "entropy", "num_tokens"):
            np.testing.assert_allclose(got[k], want[k], rtol=1e-6, atol=1e-7, err_msg=k)
