"""The kernel seam's plane-neutral half: platform plugins and the training side's weight products.

A platform plugin is a module that registers kernels for its platform with the rollout seam
(rollout/kernels.py) when imported. ``load_plugin(platform)`` imports the plugin of one platform by
its module name, so the model, the learner and the rollout core never import a plugin: the CPU's
native kernels and process knobs (laminar_jax/cpu) are loaded only when a caller asks for the
``cpu`` platform's kernels. Accelerator plugins go in ``PLUGINS`` the same way.
"""

from __future__ import annotations

import importlib
import logging
from typing import Optional

import jax.numpy as jnp

from laminar_jax.model.products import Products

_log = logging.getLogger(__name__)

# platform -> the modules that register its kernels when imported (in order).
PLUGINS: dict[str, tuple[str, ...]] = {"cpu": ("laminar_jax.cpu.kernels",),
                                       "gpu": ("laminar_jax.rollout.kernels_gpu",),
                                       "tpu": ("laminar_jax.rollout.kernels_tpu",)}


def load_plugin(platform: str) -> tuple[str, ...]:
    """Import ``platform``'s plugins (idempotent); the module names loaded. A plugin that fails to
    import is logged and skipped: its kernels are then simply not offered ('auto' falls back)."""
    loaded = []
    for name in PLUGINS.get(platform, ()):
        try:
            importlib.import_module(name)
            loaded.append(name)
        except ImportError as e:
            _log.warning("kernel plugin %s for platform %r did not import: %s", name, platform, e)
    return tuple(loaded)


def train_products(platform: str) -> Products:
    """The learner's weight products on ``platform``: XLA's dot. On the CPU low-precision products
    come out in float32 (XLA:CPU's bf16 kernels accumulate in and produce it); on accelerators in the
    compute dtype: their matrix units accumulate in float32 either way, and a float32 output made the
    backward's products float32 x float32 (the cotangent arrives in float32 and promotes its bf16
    partner), 2/3 of a bf16 learner step's matmul FLOPs at TF32 or float32 rate instead of bf16's."""
    return Products(low_out=jnp.float32 if platform == "cpu" else None)


def describe_train_attention(attention_impl: str, platform: str, reason: Optional[str] = None) -> dict:
    """The run summary's ``train_attention`` entry (learner.attention_impl as it runs)."""
    out = {"name": attention_impl, "platform": platform}
    if reason:
        out["reason"] = reason
    return out
