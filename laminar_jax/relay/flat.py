"""Pytrees <-> flat ``dict[str, np.ndarray]`` weight dicts, the relay plane's unit of exchange.

A dict that is already flat (``is_flat``: str keys -> arrays) keeps its own names.

Any other pytree is named by the project's one naming (``laminar_jax.naming``: the leaf's path with
dots, ``layers.0.w``), the names the learner publishes under; stable across processes and
deterministic (jax orders dict keys by sort). Works for plain dicts, lists, NamedTuples and flax
``nnx.State``.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from laminar_jax.naming import host_arrays, named_leaves, path_name, start_host_copies  # noqa: F401 - re-exported


def is_flat(obj: Any) -> bool:
    """True for an already-flat weight dict: str keys -> arrays (numpy, jax, ShapeDtypeStruct).

    Such a dict keeps its own names everywhere in the relay plane (publish, pull shardings,
    unflatten_like), which makes ``flatten_tree`` idempotent; any other pytree is named by
    ``keystr`` of the leaf paths.
    """
    return (isinstance(obj, Mapping) and len(obj) > 0
            and all(isinstance(k, str) for k in obj)
            and all(isinstance(v, (np.ndarray, np.generic)) or hasattr(v, "copy_to_host_async")
                    or (hasattr(v, "shape") and hasattr(v, "dtype") and not isinstance(v, Mapping))
                    for v in obj.values()))


def tree_items(pytree: Any) -> list[tuple[str, Any]]:
    """[(name, leaf)]: a flat dict's own items, else the project's one naming (laminar_jax.naming)."""
    if is_flat(pytree):
        return list(pytree.items())
    return named_leaves(pytree)


def flatten_tree(pytree: Any) -> dict[str, np.ndarray]:
    """Pytree of arrays (jax or numpy or scalars) -> {name: host np.ndarray}.

    Jax arrays are copied to host (all copies started before the first is awaited); numpy
    leaves are returned as they are (no copy).
    """
    return host_arrays(dict(tree_items(pytree)))


def unflatten_like(flat: Mapping[str, Any], template_pytree: Any, strict: bool = True) -> Any:
    """Rebuild ``template_pytree``'s structure with leaves taken from ``flat`` by name.

    Checks shape (and dtype) against template leaves that have them (arrays,
    ``jax.ShapeDtypeStruct``); ``strict`` also rejects names in ``flat`` the template lacks.
    Template leaves without a shape (e.g. ``jax.sharding.Sharding``) only supply structure.
    """
    import jax

    if is_flat(template_pytree):
        treedef, leaves = None, list(template_pytree.items())  # named by their own keys
    else:
        leaves, treedef = jax.tree_util.tree_flatten_with_path(template_pytree)
        leaves = [(path_name(p), t) for p, t in leaves]
    out, used = [], set()
    for name, tmpl in leaves:
        if name not in flat:
            raise KeyError(f"unflatten_like: weight {name!r} required by the template is missing "
                           f"(have {len(flat)} names, e.g. {sorted(flat)[:3]})")
        value = flat[name]
        shape = getattr(tmpl, "shape", None)
        if shape is not None and tuple(value.shape) != tuple(shape):
            raise ValueError(f"unflatten_like: weight {name!r} has shape {tuple(value.shape)}, "
                             f"template wants {tuple(shape)}")
        dtype = getattr(tmpl, "dtype", None)
        if dtype is not None and np.dtype(value.dtype) != np.dtype(dtype):
            raise ValueError(f"unflatten_like: weight {name!r} has dtype {value.dtype}, template wants {dtype}")
        out.append(value)
        used.add(name)
    extra = [n for n in flat if n not in used]
    if strict and extra:
        raise KeyError(f"unflatten_like: {len(extra)} weights not in the template, e.g. {extra[:3]}")
    if treedef is None:
        return {name: value for (name, _), value in zip(leaves, out)}
    return jax.tree_util.tree_unflatten(treedef, out)
