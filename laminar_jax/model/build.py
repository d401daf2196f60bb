"""Build a model from its config section, and the log-prob helper shared by learner and engine."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from laminar_jax.model.config import ModelSection
from laminar_jax.model.hf import _as_dtype, from_pretrained
from laminar_jax.model.presets import PRESETS
from laminar_jax.model.transformer import Transformer


def build_model(section: ModelSection) -> Transformer:
    """Load ``section.path`` (HF dir) or initialise ``section.preset`` with ``section.seed``."""
    dtype, param_dtype = _as_dtype(section.dtype), _as_dtype(section.param_dtype)
    if section.path:
        return from_pretrained(section.path, dtype=dtype, param_dtype=param_dtype,
                               value_head=section.value_head, seed=section.seed)
    return Transformer(PRESETS[section.preset], rngs=nnx.Rngs(section.seed), dtype=dtype,
                       param_dtype=param_dtype, value_head=section.value_head)


def token_logprobs(logits: jax.Array, targets: jax.Array, temperature: float = 1.0) -> jax.Array:
    """log softmax(logits / temperature)[targets]. logits: f[..., V]; targets: i32[...] -> f32[...].

    The one definition of a token's log-prob: the learner and the rollout engine both call it, so
    behaviour and learner log-probs agree by construction up to float error.
    """
    logits = logits.astype(jnp.float32) / temperature
    logz = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
    return picked - logz
