"""The models a Learner trains, split into graphdefs and host parameter copies.

The actor (and a separate critic) become trainable params: float32 master copies with
``learner.master_weights``, or under ``learner.lora`` the float32 adapters with the base frozen in
the serving dtype. The reference model (for the KL term) is a frozen copy of the initial actor, a
given model, or one loaded tensor by tensor onto the mesh.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from laminar_jax.learner.config import LearnerSection
from laminar_jax.learner.lora import split_actor
from laminar_jax.learner.step import Graphs
from laminar_jax.model.precision import cast_floating


def _split_params(model: nnx.Module, what: str) -> tuple[Any, nnx.State]:
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    if jax.tree.leaves(rest):
        raise ValueError(f"{what}: model has non-Param state {list(rest.keys())}; the learner trains Params only")
    return graphdef, params


def _host(tree: Any) -> Any:
    """Host copies of a model's leaves; a jax.Array stays where it is (a model loaded onto the mesh,
    model.sharded.load_model, is placed already: `place` keeps it, no whole copy is made)."""
    return jax.tree.map(lambda x: x if isinstance(x, jax.Array) else np.array(x), tree)


def load_onto(path: str, mesh: Mesh, rules: Sequence[str]) -> nnx.Module:
    """An HF directory loaded tensor by tensor straight onto its shards of ``mesh`` (model/sharded.py)."""
    from laminar_jax.learner.mesh import sharding_of
    from laminar_jax.model.config import ModelSection
    from laminar_jax.model.sharded import abstract_model, load_model

    section = ModelSection(path=path)
    return load_model(section, sharding_of(abstract_model(section), mesh, rules))


class _Models(NamedTuple):
    graphs: Graphs
    params: dict  # {'actor': nnx.State (+ 'critic')} of host arrays: the trainable params
    ref: Optional[nnx.State]  # host reference params (None without a KL term, or the LoRA base)
    frozen: Optional[dict] = None  # {'actor': the frozen base} under learner.lora (learner/lora.py)


def collect_models(section: LearnerSection, model: nnx.Module, critic_model: Optional[nnx.Module],
                    ref_model: Optional[nnx.Module], serving_dtype: Any) -> _Models:
    """Split the actor / critic / reference models into graphdefs and host param copies. With
    learner.master_weights the trainable params are float32 (the master copy, cast from the
    model's param dtype); the reference keeps its model's dtype (it is never updated). Under
    learner.lora the actor's trainable params are its float32 adapters and its base is frozen in
    ``serving_dtype``; the base is then the reference unless one is given."""
    actor_g, actor_p = _split_params(model, "model")
    if section.critic == "shared" and not getattr(model, "has_value_head", False):
        raise ValueError("learner.critic='shared' needs the actor built with value_head=True")
    master = (lambda p: cast_floating(p, np.float32)) if section.master_weights else (lambda p: p)
    frozen = None
    if section.lora.enabled:
        split = split_actor(model, section.lora, serving_dtype, _host)
        actor_g, actor_host, params, frozen = split.plain_graphdef, None, {"actor": split.adapters}, \
            {"actor": split.base}
    else:
        actor_host = _host(actor_p)
        params = {"actor": master(actor_host)}
    dtypes = {"actor": compute_dtype(model)}
    critic_g = None
    if section.critic == "separate":
        if critic_model is None or not getattr(critic_model, "has_value_head", False):
            raise ValueError("learner.critic='separate' needs critic_model built with value_head=True")
        critic_g, critic_p = _split_params(critic_model, "critic_model")
        params["critic"] = master(_host(critic_p))
        dtypes["critic"] = compute_dtype(critic_model)
    ref_g, ref = None, None
    if section.use_kl:
        if ref_model is None and section.ref_path:
            from laminar_jax.model import from_pretrained
            ref_model = from_pretrained(section.ref_path)
        if ref_model is None:  # frozen copy of the initial actor (its own buffers: the actor's get donated)
            ref_g, ref = actor_g, actor_host  # under LoRA: None, the step reads the frozen base
            dtypes["ref"] = dtypes["actor"]
        else:
            ref_g, ref_p = _split_params(ref_model, "ref_model")
            ref = _host(ref_p)
            dtypes["ref"] = compute_dtype(ref_model)
    if frozen is not None:
        actor_g = split.graphdef
    return _Models(Graphs(actor_g, critic_g, ref_g, dtypes), params, ref, frozen)


def compute_dtype(model: nnx.Module) -> Any:
    """The model's compute dtype (None: it computes in its parameters' dtype)."""
    return getattr(model, "dtype", None)
