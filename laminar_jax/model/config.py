"""Config section for the model plane."""

from __future__ import annotations

import dataclasses
from typing import Literal, Optional

from laminar_jax.configlib import expect


@dataclasses.dataclass(frozen=True)
class ModelSection:
    """Which policy model to build or load.

    Attributes:
      path: Local Hugging Face directory (config.json + *.safetensors). None builds `preset` from scratch.
      preset: Built-in architecture used when `path` is None (see laminar_jax.model.presets).
      dtype: Compute dtype: activations and weight products, in the learner (which casts its float32 master weights to it inside each step) and the rollout engine; also the default serving dtype (rollout.dtype).
      param_dtype: Dtype the model's weights are built or loaded in: the initial weights and the frozen reference copy. The learner trains a float32 master copy of them (learner.master_weights; False trains them in this dtype) and servers hold rollout.dtype.
      value_head: Add a scalar value head (critic) on top of the trunk.
      tokenizer: 'builtin' for the tiny character tokenizer, or a path to a HF tokenizer.json.
      seed: Seed for random initialisation when building from a preset.
    """

    path: Optional[str] = None
    preset: str = "tiny"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    param_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    value_head: bool = False
    tokenizer: str = "builtin"
    seed: int = 0

    def validate(self, prefix: str) -> None:
        from laminar_jax.model.presets import PRESETS

        if self.path is None:
            expect(self.preset in PRESETS, f"{prefix}.preset", self.preset, f"one of {sorted(PRESETS)}")
