"""LoRA adapters merged into a server's weights at its swap: W' = W_base + scale * (B @ A), per layer.

A server serving a LoRA run keeps its base pristine on the host (in the serving dtype) and, at each
swap, refills every targeted stacked parameter a layer at a time from that base, merging the
version's adapters into the layer on the device as it goes (``ParamPlacement.swap(..., lora=)``):
merges never accumulate (each starts from the base, not from the previous merge), the devices hold
one version plus one layer as in a full swap, and the parameters no adapter targets are left in
place untouched (they are the base already). Only adapter bytes cross the relays; the base layers
cross from this host's memory to its devices.

Why merged and not applied in the decode step (x @ W + scale * (x @ A) @ B): see
docs/ARCHITECTURE.md, "LoRA versions".
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


class LoraDelta(NamedTuple):
    """One adapter version as a swap applies it: scale and {param name: (lora_a, lora_b)} host arrays,
    stacked under the layers' scan as the parameter is."""

    scale: float
    pairs: Mapping[str, tuple[Any, Any]]


def merge(w, a, b, scale):
    """W + scale * (B @ A) computed in float32, in W's dtype (W [..., out, in], A [..., r, in],
    B [..., out, r]; leading layer axes broadcast). HIGHEST precision: accelerators would otherwise
    take float32 products in TF32, and the served weights would differ from the learner's merge."""
    try:  # the adapter contract's merge, when it is there: one definition for learner and servers
        from laminar_jax.model.lora import merge as contract_merge
    except ImportError:
        contract_merge = None
    if contract_merge is not None:
        return contract_merge(w, a, b, scale)
    delta = jnp.einsum("...or,...ri->...oi", jnp.asarray(b, jnp.float32), jnp.asarray(a, jnp.float32),
                       precision=jax.lax.Precision.HIGHEST)
    return (jnp.asarray(w).astype(jnp.float32) + scale * delta).astype(jnp.asarray(w).dtype)


_merge_jit = jax.jit(merge)


def layer_merger(delta: LoraDelta, name: str, put: Callable[[np.ndarray], jax.Array]
                 ) -> Callable[[int, jax.Array], jax.Array]:
    """merge_layer(i, placed_base_layer) -> layer i of ``name`` merged with its adapters; ``put``
    places a (small) adapter slice beside it."""
    a, b = delta.pairs[name]
    scale = np.float32(delta.scale)
    return lambda i, w: _merge_jit(w, put(np.asarray(a[i])), put(np.asarray(b[i])), scale)


def merge_whole(w: jax.Array, delta: LoraDelta, name: str, put: Callable[[np.ndarray], jax.Array]) -> jax.Array:
    """``name``'s whole placed stack merged with its adapters (a first placement: nothing to refill)."""
    a, b = delta.pairs[name]
    return _merge_jit(w, put(np.asarray(a)), put(np.asarray(b)), np.float32(delta.scale))


@functools.partial(jax.jit, static_argnums=(2,))
def _merge_named(leaves: list, adapters: list, which: tuple) -> list:
    out, k = [], 0
    for i, w in enumerate(leaves):
        if i in which:
            a, b, scale = adapters[k]
            out.append(merge(w, a, b, scale))
            k += 1
        else:
            out.append(w)
    return out


def merged_tree(base: Any, delta: LoraDelta) -> Any:
    """A placed base tree merged with ``delta`` in one program: the targeted leaves are new arrays,
    the others are the base's own (shared, unchanged). For servers that share one placed copy per
    version (no streaming): the base stays placed beside the merged leaves."""
    from laminar_jax.naming import path_name

    flat, treedef = jax.tree_util.tree_flatten_with_path(base)
    names = [path_name(p) for p, _ in flat]
    missing = sorted(set(delta.pairs) - set(names))
    if missing:
        raise ValueError(f"adapter version: parameters {missing[:3]} are not the model's (e.g. {names[:3]})")
    which = tuple(i for i, n in enumerate(names) if n in delta.pairs)
    adapters = [(delta.pairs[names[i]][0], delta.pairs[names[i]][1], np.float32(delta.scale)) for i in which]
    return jax.tree_util.tree_unflatten(treedef, _merge_named([x for _, x in flat], adapters, which))


__all__ = ["LoraDelta", "merge", "layer_merger", "merge_whole", "merged_tree"]
