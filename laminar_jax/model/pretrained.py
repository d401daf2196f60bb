"""`from_pretrained`: a local Hugging Face directory as a Transformer, read tensor by tensor onto its
shardings (model/sharded.py does the reading; model/hf.py the names and the config)."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from laminar_jax.model.config import ModelSection
from laminar_jax.model.hf import _as_dtype
from laminar_jax.model.sharded import load_model
from laminar_jax.model.transformer import Transformer


def from_pretrained(path: str, dtype: Any = jnp.float32, param_dtype: Any = None,
                    value_head: bool = False, seed: int = 0, shardings=None) -> Transformer:
    """Load a local HF directory (config.json + *.safetensors, sharded or not) as a Transformer.

    ``model(tokens_i32[B, T])`` returns f32[B, T, vocab] logits. A value head, when asked for and
    absent from the checkpoint, is freshly initialised from ``seed``. Tensors are read one at a
    time onto ``shardings(path, abstract_leaf)`` (default: the default device); see model/sharded.py.
    """
    dtype = _as_dtype(dtype)
    param_dtype = dtype if param_dtype is None else _as_dtype(param_dtype)
    section = ModelSection(path=path, dtype=dtype, param_dtype=param_dtype, value_head=value_head, seed=seed)
    return load_model(section, shardings)
