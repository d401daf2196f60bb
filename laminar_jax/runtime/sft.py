"""Moved to laminar_jax.learner.sft; this path keeps old imports working."""

from laminar_jax.learner.sft import pack_examples, sft_warmup  # noqa: F401
