"""Device mesh ('data', 'fsdp', 'tensor') and host->device placement; logical-axis rules -> shardings
are model/axes.py's (re-exported here for the learner's callers)."""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from laminar_jax.learner.config import MeshSection
from laminar_jax.model.axes import logical_to_spec, param_shardings, parse_rules, sharding_of  # noqa: F401

AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")


def resolve_mesh_shape(section: MeshSection, n_devices: int) -> tuple[int, int, int]:
    """Fill the (at most one) -1 axis with the remaining devices; the product must equal n_devices."""
    sizes = [section.data, section.fsdp, section.tensor]
    known = int(np.prod([s for s in sizes if s != -1]))
    if -1 in sizes:
        if n_devices % known:
            raise ValueError(f"mesh: {n_devices} devices do not divide by the fixed axes product {known} ({sizes})")
        sizes[sizes.index(-1)] = n_devices // known
    if int(np.prod(sizes)) != n_devices:
        raise ValueError(f"mesh: data*fsdp*tensor = {sizes} uses {int(np.prod(sizes))} devices, have {n_devices}")
    return tuple(sizes)  # type: ignore[return-value]


def build_mesh(section: MeshSection, devices: Optional[Sequence[jax.Device]] = None) -> Mesh:
    devices = list(jax.devices() if devices is None else devices)
    shape = resolve_mesh_shape(section, len(devices))
    return Mesh(np.asarray(devices, dtype=object).reshape(shape), AXES)


def state_shardings_like(tree: Any, params: Any, params_shardings: Any, mesh: Mesh) -> Any:
    """Shardings for a tree that embeds params-shaped subtrees (optimizer state: mu, nu, ...).

    A leaf whose key path ends with a parameter's full key path (and has its shape) gets that
    parameter's sharding; every other leaf (step counts, scalars) is replicated.
    """
    by_path = {}
    for (path, leaf), sh in zip(jax.tree_util.tree_flatten_with_path(params)[0], jax.tree.leaves(params_shardings)):
        by_path[tuple(path)] = (np.shape(leaf), sh)
    rep = replicated(mesh)

    def one(path, leaf):
        path = tuple(path)
        for i in range(len(path)):
            hit = by_path.get(path[i:])
            if hit is not None and hit[0] == np.shape(leaf):
                return hit[1]
        return rep

    return jax.tree_util.tree_map_with_path(one, tree)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Leading (row) dimension split over ('data', 'fsdp'); everything else replicated."""
    return NamedSharding(mesh, P(BATCH_AXES))


def lookup_table_sharding(mesh: Mesh, vocab: int) -> NamedSharding:
    """The embedding table as the token lookup reads it: its vocab rows over 'tensor' (where they
    divide), each row whole, i.e. gathered over the batch axes. The table is stored split over FSDP
    along the embed axis; a lookup of batch-sharded tokens into that layout makes a hidden-sharded
    residual stream, which the partitioner then keeps by gathering every device's rows of the
    activations (each device held the whole micro-batch's MLP intermediates and logit chunks) instead
    of gathering the weights, as FSDP means to."""
    t = mesh.shape["tensor"]
    return NamedSharding(mesh, P("tensor" if t > 1 and vocab % t == 0 else None, None))


def gathered_lookup(params: Any, mesh: Optional[Mesh]) -> Any:
    """``params`` (a model's state, as the train step sees it) with the embedding table constrained to
    `lookup_table_sharding` where the mesh splits the batch: the table is gathered once per pass
    (its gradient goes back reduce-scattered: `_gathered`), and the rows stay split over the batch axes."""
    if mesh is None or mesh.shape["data"] * mesh.shape["fsdp"] == 1:
        return params

    def one(path, x):
        keys = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
        if "embed_tokens" in keys and getattr(x, "ndim", 0) == 2:
            return _gathered(x, lookup_table_sharding(mesh, x.shape[0]), _split_table_sharding(mesh, x.shape))
        return x

    return jax.tree_util.tree_map_with_path(one, params)


def _split_table_sharding(mesh: Mesh, shape: tuple) -> NamedSharding:
    """The table's gradient as the update wants it: vocab rows over 'tensor', the embed axis over
    'fsdp' (the default rules' layout of the stored table), where they divide."""
    t, f = mesh.shape["tensor"], mesh.shape["fsdp"]
    return NamedSharding(mesh, P("tensor" if t > 1 and shape[0] % t == 0 else None,
                                 "fsdp" if f > 1 and shape[1] % f == 0 else None))


def _gathered(x: jax.Array, gathered: NamedSharding, split: NamedSharding) -> jax.Array:
    """``x`` constrained to ``gathered``, its cotangent to ``split``. A plain constraint's transpose
    constrains the cotangent to ``gathered`` too: the partitioner then all-reduces the table's
    whole gradient (the TPU compiler held it in f32 and in the compute dtype) where a
    reduce-scatter leaves each device its shard."""
    @jax.custom_vjp
    def constrain(x):
        return jax.lax.with_sharding_constraint(x, gathered)

    def fwd(x):
        return constrain(x), None

    def bwd(_, g):
        return (jax.lax.with_sharding_constraint(g, split),)

    constrain.defvjp(fwd, bwd)
    return constrain(x)


def rows_split(mesh: Optional[Mesh]) -> Optional[Callable]:
    """The activations' constraint per layer where the mesh splits the batch: rows over the batch
    axes. The layers' scan carries the residual stream through a loop, where the partitioner has no
    lookup output to follow and may keep every device's rows; None without a split batch."""
    if mesh is None or mesh.shape["data"] * mesh.shape["fsdp"] == 1:
        return None
    return lambda x: jax.lax.with_sharding_constraint(x, batch_sharding(mesh))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def place(tree: Any, shardings: Any) -> Any:
    """Host (numpy / jax) pytree -> global jax.Arrays with the given shardings.

    Every process passes the same full value; each takes the shards it owns
    (make_array_from_callback), so this works single- and multi-process alike. A jax.Array
    already on its sharding (a model loaded onto the mesh) is kept as it is, never gathered.
    """

    def one(x, s):
        if isinstance(x, jax.Array) and x.sharding.is_equivalent_to(s, x.ndim):
            return x
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, s, lambda idx: x[idx])

    return jax.tree.map(one, tree, shardings)
