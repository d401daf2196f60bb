"""bench learner --memory-plan's verdict: state (16 B/param) sharded over devices + one row's residuals;
the residuals come from laminar_jax.learner.memory (production code, no benchmark import)."""

import jax.numpy as jnp

from laminar_jax.benchmarks.learner import fit_line, plan_fit
from laminar_jax.learner import LearnerSection
from laminar_jax.learner.memory import activation_bytes_per_row, residual_bytes
from laminar_jax.model import PRESETS


def _plan(params, residual_gb, device_gb, devices):
    plan = {"params": params, "residual_gb": residual_gb, "rows": 1, "seq": 18432}
    plan.update(plan_fit(plan, device_gb, devices))
    return plan


def test_fit_verdicts_and_fewest_devices():
    one = _plan(7.6e9, 32.5, 80.0, 1)  # 121.6 GB of state + 32.5 GB on one 80 GB device
    assert not one["fits"] and one["min_devices"] == 3
    assert fit_line(one).startswith("DOES NOT FIT: [1 x 18432] needs 154.1 GB") and ">= 3 devices" in fit_line(one)
    eight = _plan(7.6e9, 32.5, 80.0, 8)
    assert eight["fits"] and abs(eight["need_gb_per_device"] - (121.6 / 8 + 32.5)) < 1e-6
    assert fit_line(eight).startswith("FITS")
    huge_row = _plan(1e9, 90.0, 80.0, 64)
    assert not huge_row["fits"] and huge_row["min_devices"] is None and "residuals alone" in fit_line(huge_row)


def test_remat_shrinks_the_activations_per_row():
    cfg = PRESETS["small"]
    none = activation_bytes_per_row(cfg, LearnerSection(remat="none"), 128, jnp.float32)
    full = activation_bytes_per_row(cfg, LearnerSection(remat="full"), 128, jnp.float32)
    assert 0 < full < none
    assert residual_bytes(cfg, LearnerSection(), 2, 128, jnp.float32) > none  # weights are in the residuals too


def test_one_layer_whole_is_the_stacks_growth_per_layer():
    """Under the layers' scan the residuals are stacked [num_layers, ...]: one layer's share is the
    growth from one layer to two, and a pass under a remat policy holds that layer whole besides."""
    import dataclasses

    from laminar_jax.learner.memory import layer_bytes_per_row, pass_bytes_per_row

    cfg = PRESETS["small"]
    none = LearnerSection(remat="none")
    layer = layer_bytes_per_row(cfg, none, 128, jnp.float32)
    three = activation_bytes_per_row(dataclasses.replace(cfg, num_layers=3), none, 128, jnp.float32)
    two = activation_bytes_per_row(dataclasses.replace(cfg, num_layers=2), none, 128, jnp.float32)
    assert layer > 0 and three - two == layer
    full = LearnerSection(remat="full")
    assert pass_bytes_per_row(cfg, full, 128, jnp.float32) == \
        activation_bytes_per_row(cfg, full, 128, jnp.float32) + layer_bytes_per_row(cfg, full, 128, jnp.float32)
