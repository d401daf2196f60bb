"""LoRA adapters: the config section, which parameters they target, their names and shapes, and
the merge. This module is the adapter contract every plane speaks.

Config (``learner.lora``, `LoRASection`): ``rank`` (0 = off: full fine-tuning), ``alpha``
(scale = alpha / rank, as PEFT without rsLoRA), ``targets`` (module names: 'q_proj', 'k_proj',
'v_proj', 'o_proj', 'gate_proj', 'up_proj', 'down_proj', or 'lm_head' on an untied model),
``dropout`` (PEFT's lora_dropout: in the learner's training forward only, `with_dropout`).

Targeted parameters (`targeted_params`): the Linear weights, flat-named as
``learner.publish.flatten_params`` names them, whose module (the name's part before '.weight') is
in ``targets``: e.g. 'layers.self_attn.q_proj.weight'. Linear weights are stored [out, in]
(model/transformer.py `Linear`, HF's layout); those under 'layers.' stack every layer's on a
leading layer axis: [L, out, in].

Adapter tensors (`adapter_names`, `adapter_shapes`), per targeted parameter '<module>.weight':
  '<module>.lora_a'  [(L,) rank, in]   float32 (trained)
  '<module>.lora_b'  [(L,) out, rank]  float32 (trained; zeros at the start, so an untrained
                                        adapter leaves the model unchanged)
e.g. 'layers.self_attn.q_proj.lora_a' f32[L, r, in]. Stacked parameters' adapters are stacked the
same way (layer l at index l). These are also the adapters' flat names in the learner's state
(the LoRAParam attributes `attach` puts on each targeted Linear), so flatten_params of the
adapters yields exactly these names. Per layer they are PEFT's lora_A.weight [r, in] and
lora_B.weight [out, r] (model/peft.py writes them under PEFT's names).

Merge (`merge`): W' = W + scale * (B @ A), batched over a leading layer axis, computed in
float32 and returned in W's dtype. The adapted Linear computes y = x W^T + scale * (x A^T) B^T,
which is x W'^T.

Dropout (`with_dropout`): the training forward computes scale * (drop(x) A^T) B^T, drop(x) zeroing
each input element with probability ``dropout`` and scaling the rest by 1 / (1 - dropout), a mask
of its own per adapted module and layer (PEFT's lora_dropout). Only the learner's gradient pass
sets it; log-prob, reference and old-policy passes, serving and export never do (the merge has no
dropout).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from laminar_jax.configlib import ConfigError, expect

# The Linear modules of the decoder (model/transformer.py); an untied model also has 'lm_head'.
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
STACKED_PREFIX = "layers."  # flat names under it carry a leading layer axis (model/hf.py STACKED)
SUFFIX_A, SUFFIX_B = "lora_a", "lora_b"


@dataclasses.dataclass(frozen=True)
class LoRASection:
    """Low-rank adapters trained on a frozen base (learner.lora).

    Attributes:
      rank: Adapter rank r; 0 trains every parameter (full fine-tuning). With r > 0 the base weights are frozen (no gradients, no optimizer state, held in rollout.dtype) and only float32 adapters A [r, in] and B [out, r] of each targeted projection train, W' = W + (alpha / r) * B @ A. Must not exceed min(in, out) of any targeted projection (checked at finalize against the model).
      alpha: LoRA alpha; the adapters' product is scaled by alpha / rank (PEFT's lora_alpha).
      targets: Module names whose weights get adapters: any of 'q_proj', 'k_proj', 'v_proj', 'o_proj', 'gate_proj', 'up_proj', 'down_proj' (and 'lm_head' on a model with untied embeddings). A name the model lacks is refused at finalize.
      dropout: Dropout probability on the adapters' input in the learner's training forward (PEFT's lora_dropout), in [0, 1): delta = scale * B @ A @ dropout(x). Never in log-prob, reference or old-policy passes, serving or export. Each optimizer update draws its masks from the TrainState's key (learner.seed, advanced every update and checkpointed, so a resume draws the same masks), a fresh mask per micro-batch, adapted module and layer. Ignored at rank 0.
      seed: Seed of the adapters' A initialisation (B starts at zero).
    """

    rank: int = 0
    alpha: float = 16.0
    targets: tuple[str, ...] = PROJECTIONS
    dropout: float = 0.0
    seed: int = 0

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank if self.rank else 0.0

    def validate(self, prefix: str) -> None:
        expect(self.rank >= 0, f"{prefix}.rank", self.rank, ">= 0 (0 = full fine-tuning)")
        expect(self.alpha > 0, f"{prefix}.alpha", self.alpha, "> 0")
        expect(len(self.targets) > 0 and len(set(self.targets)) == len(self.targets), f"{prefix}.targets",
               self.targets, "a non-empty list of distinct module names")
        expect(0.0 <= self.dropout < 1.0, f"{prefix}.dropout", self.dropout, "in [0, 1)")


def is_stacked(name: str) -> bool:
    return name.startswith(STACKED_PREFIX)


def linear_weights(param_shapes: Mapping[str, Sequence[int]]) -> dict[str, tuple[int, int]]:
    """{flat name: (in, out)} of every Linear weight among a model's flat parameter shapes
    ('<module>.weight' of rank 2, or rank 3 when stacked; norms' weights are one rank lower)."""
    out = {}
    for name, shape in param_shapes.items():
        if not name.endswith(".weight") or "." not in name:
            continue
        if len(shape) == (3 if is_stacked(name) else 2):
            out[name] = (int(shape[-1]), int(shape[-2]))
    return out


def module_of(name: str) -> str:
    """'layers.self_attn.q_proj.weight' -> 'q_proj'."""
    return name.split(".")[-2]


def module_names(param_shapes: Mapping[str, Sequence[int]]) -> list[str]:
    """The model's Linear module names (what `targets` may name), sorted; the value head is never a target."""
    return sorted({module_of(n) for n in linear_weights(param_shapes)} - {"value_head"})


def targeted_params(param_shapes: Mapping[str, Sequence[int]], targets: Sequence[str]) -> dict[str, tuple[int, int]]:
    """{flat name: (in, out)} of the Linear weights whose module is in ``targets``, in name order."""
    lin = linear_weights(param_shapes)
    return {n: lin[n] for n in sorted(lin) if module_of(n) in targets and module_of(n) != "value_head"}


def check_targets(section: LoRASection, param_shapes: Mapping[str, Sequence[int]],
                  prefix: str = "learner.lora") -> dict[str, tuple[int, int]]:
    """The targeted params; ConfigError naming ``<prefix>.targets`` for a name that matches nothing,
    or ``<prefix>.rank`` for a rank above min(in, out) of a targeted weight, listing the model's modules."""
    names = module_names(param_shapes)
    missing = [t for t in section.targets if t not in names]
    if missing:
        raise ConfigError(f"{prefix}.targets={list(section.targets)!r}: {missing} match no module of the model; "
                          f"its Linear modules are {names}")
    targeted = targeted_params(param_shapes, section.targets)
    for name, (din, dout) in targeted.items():
        if section.rank > min(din, dout):
            raise ConfigError(f"{prefix}.rank={section.rank}: must be <= min(in, out)={min(din, dout)} of {name} "
                              f"[out={dout}, in={din}]; the model's Linear modules are {names}")
    return targeted


def adapter_names(param: str) -> tuple[str, str]:
    """'layers.self_attn.q_proj.weight' -> ('layers.self_attn.q_proj.lora_a', '...lora_b')."""
    stem = param[: -len(".weight")]
    return f"{stem}.{SUFFIX_A}", f"{stem}.{SUFFIX_B}"


def base_name(adapter: str) -> str:
    """Inverse of `adapter_names`: '<module>.lora_a' / '<module>.lora_b' -> '<module>.weight'."""
    stem, _, suffix = adapter.rpartition(".")
    if suffix not in (SUFFIX_A, SUFFIX_B):
        raise ValueError(f"{adapter!r} is not an adapter tensor name (ends in .{SUFFIX_A} or .{SUFFIX_B})")
    return f"{stem}.weight"


def adapter_shapes(param_shapes: Mapping[str, Sequence[int]], targets: Sequence[str],
                   rank: int) -> dict[str, tuple[int, ...]]:
    """{adapter name: shape} for every targeted param: A [(L,) r, in], B [(L,) out, r]."""
    out = {}
    for name, (din, dout) in targeted_params(param_shapes, targets).items():
        lead = tuple(int(s) for s in param_shapes[name][:-2])
        a, b = adapter_names(name)
        out[a], out[b] = lead + (rank, din), lead + (dout, rank)
    return out


def merge(base_weight: Any, a: Any, b: Any, scale: float) -> Any:
    """W + scale * (B @ A) in float32, returned in W's dtype. W [(L,) out, in], A [(L,) r, in],
    B [(L,) out, r]; numpy or jax arrays (the operators of W's own array module)."""
    w32 = base_weight.astype(np.float32)
    return (w32 + scale * (b.astype(np.float32) @ a.astype(np.float32))).astype(base_weight.dtype)


def merge_params(base: Mapping[str, Any], adapters: Mapping[str, Any], scale: float) -> dict[str, Any]:
    """Flat base params with every adapted weight merged (`merge`); other params unchanged."""
    out = dict(base)
    for name in sorted({base_name(n) for n in adapters}):
        if name not in base:
            raise ValueError(f"adapter for {name}: the base has no such parameter")
        a, b = adapter_names(name)
        out[name] = merge(base[name], adapters[a], adapters[b], scale)
    return out


def param_shapes_of(model_cfg, value_head: bool = False) -> dict[str, tuple[int, ...]]:
    """Flat parameter shapes of a TransformerConfig's model, abstractly (no parameter memory)."""
    from flax import nnx

    from laminar_jax.model.transformer import Transformer
    from laminar_jax.naming import path_name

    import jax

    model = nnx.eval_shape(lambda: Transformer(model_cfg, rngs=nnx.Rngs(0), value_head=value_head))
    return {path_name(p): tuple(x.shape)
            for p, x in jax.tree_util.tree_flatten_with_path(nnx.state(model, nnx.Param))[0]}


def attach(model: Any, section: LoRASection, seed: Optional[int] = None) -> Any:
    """A new module of ``model``'s graph (sharing its arrays) with float32 adapters (nnx.LoRAParam)
    on each targeted Linear: lora_a ~ U(-1/sqrt(in), 1/sqrt(in)) (PEFT's Kaiming-uniform bound),
    lora_b = 0, and the Linear's ``lora_scale``. ``model`` itself is unchanged."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from laminar_jax.naming import path_name

    graphdef, state = nnx.split(model)
    model = nnx.merge(graphdef, state)
    shapes = {path_name(p): tuple(x.shape)
              for p, x in jax.tree_util.tree_flatten_with_path(nnx.state(model, nnx.Param))[0]}
    targeted = check_targets(section, shapes)
    key = jax.random.key(section.seed if seed is None else seed)
    for i, name in enumerate(targeted):
        module = model
        for part in name.split(".")[:-1]:
            module = getattr(module, part)
        a_shape, b_shape = adapter_shapes({name: shapes[name]}, section.targets, section.rank).values()
        axes = module.weight.get_metadata().get("out_sharding") or (None,) * len(shapes[name])
        lead = tuple(axes[:-2])
        bound = 1.0 / np.sqrt(a_shape[-1])
        a = jax.random.uniform(jax.random.fold_in(key, i), a_shape, jnp.float32, -bound, bound)
        module.lora_a = nnx.LoRAParam(a, out_sharding=lead + (None, axes[-1]), eager_sharding=False)
        module.lora_b = nnx.LoRAParam(jnp.zeros(b_shape, jnp.float32), out_sharding=lead + (axes[-2], None),
                                      eager_sharding=False)
        module.lora_scale = float(section.scale)
    return model


def with_dropout(model: Any, rate: float, key: Any) -> Any:
    """``model`` (adapters attached; changed in place: a model merged inside the training trace) with
    adapter dropout at ``rate`` on every adapted Linear, its masks drawn from ``key``: the i-th adapted
    module in flat-name order gets fold_in(key, i), split per layer when stacked (the layers' scan
    slices the keys with the weights). rate 0 leaves the model as it is."""
    import jax
    from flax import nnx

    from laminar_jax.model.transformer import DropoutKey
    from laminar_jax.naming import path_name

    if rate == 0.0:
        return model
    names = sorted({path_name(p).rpartition(".")[0]
                    for p, _ in jax.tree_util.tree_flatten_with_path(nnx.state(model, nnx.LoRAParam))[0]})
    for i, stem in enumerate(names):
        module = model
        for part in stem.split("."):
            module = getattr(module, part)
        k = jax.random.fold_in(key, i)
        lead = module.lora_a.shape[:-2]
        module.lora_dropout_key = DropoutKey(jax.random.key_data(jax.random.split(k, lead) if lead else k))
        module.lora_dropout = float(rate)
    return model
