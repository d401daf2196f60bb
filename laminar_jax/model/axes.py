"""Logical-axis rules -> shardings: a parameter's logical axes (its `out_sharding` metadata) and a
rule table ('embed=fsdp', 'heads=tensor', ...) give its PartitionSpec on a mesh. The learner's mesh
(learner/mesh.py) and the rollout's tensor-parallel layout (rollout/tp.py) both read them."""

from __future__ import annotations

from typing import Any, Optional, Sequence

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P


def parse_rules(rules: Sequence[str]) -> dict[str, Optional[str]]:
    """('embed=fsdp', 'norm=') -> {'embed': 'fsdp', 'norm': None}."""
    out: dict[str, Optional[str]] = {}
    for r in rules:
        name, _, axis = r.partition("=")
        out[name.strip()] = axis.strip() or None
    return out


def logical_to_spec(logical: Sequence[Optional[str]], shape: Sequence[int], rules: dict[str, Optional[str]],
                    mesh: Mesh) -> P:
    """Map one parameter's logical axes to a PartitionSpec.

    A dimension stays replicated when it has no rule, when it does not divide by the mesh axis
    size, or when the mesh axis is already used by an earlier dimension.
    """
    used: set[str] = set()
    out = []
    for name, dim in zip(logical, shape):
        axis = rules.get(name) if name is not None else None
        if axis is None or axis in used or dim % mesh.shape[axis] or mesh.shape[axis] == 1:
            out.append(None)
        else:
            out.append(axis)
            used.add(axis)
    return P(*out)


def param_shardings(params: nnx.State, mesh: Mesh, rules: Sequence[str]) -> Any:
    """Pytree of NamedSharding matching `params` (an nnx.State of Params with logical axis metadata)."""
    table = parse_rules(rules)

    def one(var):
        shape = var.get_value().shape
        logical = getattr(var, "out_sharding", None) or (None,) * len(shape)
        return var.replace(NamedSharding(mesh, logical_to_spec(logical, shape, table, mesh)))

    return jax.tree.map(one, params, is_leaf=lambda x: isinstance(x, nnx.Variable))


def sharding_of(model: nnx.Module, mesh: Mesh, rules: Sequence[str]):
    """(state path, leaf) -> NamedSharding of that parameter on ``mesh`` (a model's loader takes it,
    model.sharded.load_model: every tensor goes straight to its shards). ``model`` may be abstract."""
    shardings = nnx.to_pure_dict(param_shardings(nnx.state(model), mesh, rules))

    def one(path: tuple, leaf) -> NamedSharding:
        node = shardings
        for k in path:
            node = node[k]
        return node

    return one
