"""What one gradient pass keeps for its backward pass, from abstract shapes (nothing allocated, no
device needed): the memory planner's activation figure (placement_memory.py) and `bench learner
--memory-plan`'s residuals."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from laminar_jax.learner.batch import TrainBatch
from laminar_jax.learner.config import LearnerSection
from laminar_jax.learner.losses import agg_norm
from laminar_jax.learner.step import Graphs, make_loss_fn
from laminar_jax.model.arch import TransformerConfig
from laminar_jax.model.transformer import Transformer


def abstract_batch(rows: int, seq: int) -> TrainBatch:
    """ShapeDtypeStructs of a collated [rows, seq] TrainBatch (no shardings)."""
    i32 = jax.ShapeDtypeStruct((rows, seq), jnp.int32)
    f32 = jax.ShapeDtypeStruct((rows, seq), jnp.float32)
    per_row = jax.ShapeDtypeStruct((rows,), jnp.int32)
    return TrainBatch(tokens=i32, targets=i32, positions=i32, segment_ids=i32, loss_mask=f32,
                      behaviour_logprobs=f32, rewards=jax.ShapeDtypeStruct((rows,), jnp.float32),
                      group_ids=per_row, versions=per_row, seq_ids=i32, old_logprobs=f32, prox_logprobs=f32,
                      ref_logprobs=f32, old_values=f32, advantages=f32, returns=f32, seq_tokens=f32)


def abstract_pass(cfg: TransformerConfig, section: LearnerSection, rows: int, seq: int, dtype):
    """(abstract params, abstract batch, graphs, bytes of the residuals autodiff keeps) of one gradient pass.

    The library kernels ('tokamax', 'splash', and 'auto', which picks one on an accelerator) keep what
    'flash' keeps (q, k, v, the output and its log-sum-exp; no [T, T] scores) and cannot be traced
    off their platform, so the plan traces 'flash' for them."""
    if section.attention_impl in ("auto", "tokamax", "splash"):
        section = dataclasses.replace(section, attention_impl="flash")
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=jnp.float32))
    graphdef, params = nnx.split(model)
    batch = abstract_batch(rows, seq)
    graphs = Graphs(graphdef, None, None)
    loss_fn = make_loss_fn(section, graphs)

    def residuals(p, b):
        norm = agg_norm(b.loss_mask, b.seq_tokens)
        return jax.vjp(lambda q: loss_fn(q, b, norm)[0], p)[1]  # a Partial whose leaves are the residuals

    saved = jax.eval_shape(residuals, {"actor": params}, batch)
    return params, batch, graphs, sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(saved))


def residual_bytes(cfg: TransformerConfig, section: LearnerSection, rows: int, seq: int, dtype) -> int:
    """Bytes of the activations one gradient pass over [rows, seq] keeps for its backward pass (no compile)."""
    return abstract_pass(cfg, section, rows, seq, dtype)[3]


def activation_bytes_per_row(cfg: TransformerConfig, section: LearnerSection, seq: int, dtype) -> int:
    """The residuals' growth per packed row of ``seq`` tokens. The residuals also hold the weights
    (and their compute-dtype casts), which do not grow with the rows and the planner counts apart."""
    return residual_bytes(cfg, section, 2, seq, dtype) - residual_bytes(cfg, section, 1, seq, dtype)


def layer_bytes_per_row(cfg: TransformerConfig, section: LearnerSection, seq: int, dtype) -> int:
    """Every activation of one decoder layer per packed row of ``seq`` tokens (its residuals without
    remat): what the backward pass holds while it recomputes a layer under a remat policy. Under
    the layers' scan the saved residuals are stacked [num_layers, ...], so one layer's is the
    stack's growth from one layer to two."""
    none = dataclasses.replace(section, remat="none")
    one, two = (activation_bytes_per_row(dataclasses.replace(cfg, num_layers=n), none, seq, dtype) for n in (1, 2))
    return two - one


def pass_bytes_per_row(cfg: TransformerConfig, section: LearnerSection, seq: int, dtype) -> int:
    """What one gradient pass holds at its peak per packed row: the residuals of every layer
    (stacked by the scan, as ``section.remat`` saves them) and one layer's activations whole: the
    layer the backward pass recomputes under a remat policy, or, without remat, the cotangents of
    the layer it differentiates (as large as the layer's activations)."""
    return activation_bytes_per_row(cfg, section, seq, dtype) + layer_bytes_per_row(cfg, section, seq, dtype)
