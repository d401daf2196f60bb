"""The learner's LoRA state (learner.lora; the adapter contract is laminar_jax.model.lora).

Why adapters on our own Linear, not `nnx.LoRALinear` or qwix: the model's Linear is custom (weight
[out, in], the products seam, low-precision accumulation) and its layers are one stacked module run
as a scan, so a wrapper library's module would change the parameter names HF loading, publishing
and the rollout swap rely on ('...q_proj.weight'), and would not stack. `model.lora.attach` puts
flax's own `nnx.LoRAParam` variables on each targeted Linear instead, stacked like its weight (one
[L, r, in] / [L, out, r] pair per projection, sliced per layer by the same scan), and the Linear adds
the low-rank path; `nnx.split(model, nnx.LoRAParam, nnx.Param)` then splits the state into
(trainable adapters, frozen base) by type.

The optimizer sees only the adapters: the learner's TrainState holds them as `params` (float32, as
master weights) and the base as `frozen` (the serving dtype: what the rollout servers hold, so a
merged version needs no other copy), joined inside the step (learner.step.join) and differentiated
by the adapters alone: no gradient, no AdamW moment, no master copy of the base exists. A mask
(optax.multi_transform / set_to_zero) over the whole tree would still compute and hold the base's
gradients.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import jax
import numpy as np
from flax import nnx

from laminar_jax.learner.publish import flatten_params
from laminar_jax.model import lora
from laminar_jax.model.precision import cast_floating


class LoRAModels(NamedTuple):
    graphdef: Any  # the adapted actor's graph (adapters attached)
    plain_graphdef: Any  # the actor's graph without adapters (the base alone: the KL reference)
    adapters: nnx.State  # float32, host
    base: nnx.State  # in the serving dtype, host


def split_actor(model: nnx.Module, section: lora.LoRASection, serving_dtype: Any, host) -> LoRAModels:
    """The actor split into trainable adapters and the frozen base (``host``: the learner's host copy)."""
    plain_graphdef = nnx.split(model, nnx.Param, ...)[0]
    adapted = lora.attach(model, section)
    graphdef, adapters, base, rest = nnx.split(adapted, nnx.LoRAParam, nnx.Param, ...)
    if jax.tree.leaves(rest):
        raise ValueError(f"model: non-Param state {list(rest.keys())}; the learner trains Params only")
    return LoRAModels(graphdef, plain_graphdef, cast_floating(host(adapters), np.float32),
                      cast_floating(host(base), serving_dtype))


def merged_fn(scale: float, dtype: Any):
    """A jitted (adapters, base) -> the flat policy weights with every adapter merged, in ``dtype``
    (new buffers: no train step donates them, so the host copy may read them while the next step runs)."""

    def merged(adapters, base):
        flat = lora.merge_params(flatten_params(base), flatten_params(adapters), scale)
        return cast_floating(flat, dtype)

    return jax.jit(merged)


def adapter_bytes(adapters: Any, itemsize: Optional[int] = None) -> int:
    """Bytes of the adapters (at ``itemsize`` bytes per value, default their own dtype's)."""
    return sum(int(np.prod(x.shape)) * (itemsize or np.dtype(x.dtype).itemsize) for x in jax.tree.leaves(adapters))


def export(learner, model_section, out_dir: str) -> dict[str, str]:
    """A LoRA learner's policy as ``<out_dir>/merged`` (a self-contained HF directory of the base with
    the adapters merged, in the serving dtype: model/export.py) and ``<out_dir>/adapter`` (PEFT's
    adapter_config.json + adapter_model.safetensors, model/peft.py). Returns both paths."""
    import os

    from laminar_jax.learner.publish import unflatten_params
    from laminar_jax.model.export import write_hf_dir
    from laminar_jax.model.peft import write_peft_adapter
    from laminar_jax.model.sharded import abstract_model

    section = learner.section.lora
    model = abstract_model(model_section)
    graphdef, state = nnx.split(model)
    nnx.update(model, unflatten_params(learner.policy_params(), state))
    merged, adapter = os.path.join(out_dir, "merged"), os.path.join(out_dir, "adapter")
    write_hf_dir(model, model_section, merged)
    write_peft_adapter(learner.adapter_params(), section, adapter, base_model=model_section.path)
    return {"merged": merged, "adapter": adapter}
