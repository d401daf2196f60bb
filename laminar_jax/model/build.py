"""Build a model from its config section, and the log-prob helper shared by learner and engine."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from laminar_jax.model.config import ModelSection
from laminar_jax.model.transformer import Transformer


def build_model(section: ModelSection, shardings=None) -> Transformer:
    """Load ``section.path`` (HF dir) or initialise ``section.preset`` with ``section.seed``, every
    parameter straight onto ``shardings(path, abstract_leaf)`` (default: the default device);
    see model/sharded.py."""
    from laminar_jax.model.sharded import load_model

    return load_model(section, shardings)


def token_logprobs(logits: jax.Array, targets: jax.Array, temperature: float = 1.0) -> jax.Array:
    """log softmax(logits / temperature)[targets]. logits: f[..., V]; targets: i32[...] -> f32[...].

    The one definition of a token's log-prob: the learner and the rollout engine both call it, so
    behaviour and learner log-probs agree by construction up to float error.
    """
    logits = logits.astype(jnp.float32) / temperature
    logz = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
    return picked - logz
