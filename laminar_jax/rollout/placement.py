"""An engine's weights on its devices: placement, in-place swap, release, and the flattened leaves
its programs run on.

One ``ParamPlacement`` per engine: the engine's devices (one default device, or a tensor mesh in
the Megatron layout of rollout/tp.py), the per-leaf shardings of the params tree it last saw, and
one cache entry (the params object last bound, its flattened and placed leaves, and whatever the
engine built for its tree structure), so a call with the same params object costs no flattening.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from laminar_jax.model.hf import is_stacked
from laminar_jax.naming import path_name
from laminar_jax.rollout import tp as tpl
from laminar_jax.rollout.layered import refill_stacked
from laminar_jax.rollout.lora_merge import LoraDelta, layer_merger, merge_whole


class ParamPlacement:
    """Weights on one engine's devices. Not thread-safe: the engine's owner calls it."""

    def __init__(self, mesh: Any = None):
        self.mesh = mesh
        self.devices = list(mesh.devices.flat) if mesh is not None else [jax.devices()[0]]
        self._shardings: tuple = (None, None)  # (params treedef, [NamedSharding per leaf])
        self._bound: tuple = (None, None, None)  # (params, leaves, built) last seen by bind()

    def bind(self, params, build: Callable[[Any], Any]) -> tuple[list, Any]:
        """(flattened params in this layout, build(treedef)), computed once per params object.

        Flattening an nnx.State (and hashing the graphdef for a jit cache lookup) costs
        milliseconds, so it happens once per params object, not once per call.
        """
        if self._bound[0] is not params:
            leaves, treedef = jax.tree.flatten(params)
            if self.mesh is not None:  # a no-op for params already in this layout (place())
                leaves = tpl.place_leaves(leaves, self.shardings(params))
            self._bound = (params, leaves, build(treedef))
        return self._bound[1], self._bound[2]

    def shardings(self, params) -> list:
        """NamedSharding per leaf of ``jax.tree.leaves(params)`` in this TP layout."""
        if self.mesh is None:
            raise ValueError("ParamPlacement.shardings: this engine has no mesh")
        treedef = jax.tree.structure(params)
        if self._shardings[0] is None or self._shardings[0] != treedef:
            self._shardings = (treedef, tpl.param_shardings_list(params, self.mesh))
        return self._shardings[1]

    def place(self, params):
        """params (host numpy or device arrays) -> the same tree in this layout.

        A host leaf sends each device only its own shard (make_array_from_callback). Without a
        mesh: one device_put onto the default device.
        """
        if self.mesh is None:
            return jax.device_put(params)
        leaves, treedef = jax.tree.flatten(params)
        return jax.tree.unflatten(treedef, tpl.place_leaves(leaves, self.shardings(params)))

    def swap(self, old, host, on_leaf: Optional[Callable[[int, jax.Array], None]] = None,
             lora: Optional[LoraDelta] = None):
        """The weights ``old`` replaced by the host tree ``host`` (same structure) one tensor at a
        time: each old buffer is deleted before its replacement is placed, so the devices hold one
        version plus one tensor at any moment, never two versions. The caller owns ``old`` (no other
        server runs on those buffers) and has no program in flight on them. on_leaf(i, placed) is
        called after each placement (tests measure the devices' live bytes there). ``lora``: ``host``
        is the pristine base and these adapters are merged into it layer by layer; leaves they do
        not target are kept in place (rollout/lora_merge.py)."""
        old_leaves = jax.tree.leaves(old)
        host_leaves, treedef = jax.tree.flatten(host)
        if len(old_leaves) != len(host_leaves):
            raise ValueError(f"ParamPlacement.swap: {len(host_leaves)} new tensors for {len(old_leaves)} old ones")
        cached = self._bound[1] if self._bound[0] is old else None  # bind()'s resharded copies
        self._bound = (None, None, None)
        shardings = self.shardings(host) if self.mesh is not None else None
        paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(host)[0]]
        stacked = [is_stacked(tuple(getattr(k, "key", getattr(k, "name", k)) for k in p[:1])) for p in paths]
        names = [path_name(p) for p in paths] if lora else []
        put = (lambda x: jax.device_put(x, self.devices[0])) if self.mesh is None else \
            (lambda x: jax.device_put(x, jax.sharding.NamedSharding(self.mesh, P())))  # adapters: replicated
        new = []
        for i, (o, h) in enumerate(zip(old_leaves, host_leaves)):
            merge = lora is not None and names[i] in lora.pairs
            if lora is not None and not merge and _refillable(o, h):  # the base, unchanged by any adapter
                new.append(o)
                continue
            in_place = stacked[i] and _refillable(o, h)  # the layer stack: refilled a layer at a time
            for x in ([] if in_place else [o]) + ([] if cached is None or cached[i] is o else [cached[i]]):
                if isinstance(x, jax.Array) and not x.is_deleted():
                    x.delete()
            if in_place:
                layer = None if shardings is None else jax.sharding.NamedSharding(self.mesh, P(*o.sharding.spec[1:]))
                new.append(refill_stacked(o, h, lambda x: jax.device_put(x, self.devices[0]) if layer is None
                                          else tpl.place_leaf(x, layer),
                                          layer_merger(lora, names[i], put) if merge else None))
            else:
                new.append(jax.device_put(h, self.devices[0]) if shardings is None
                           else tpl.place_leaf(h, shardings[i]))
                if merge:
                    new[-1] = merge_whole(new[-1], lora, names[i], put)
            if on_leaf is not None:
                on_leaf(i, new[-1])
        return jax.tree.unflatten(treedef, new)

    def release(self, params) -> None:
        """Delete every buffer of ``params`` (and any resharded copy bind() keeps) now; the caller
        owns them and will not run on them again."""
        cached = self._bound[1] if self._bound[0] is params else []
        self._bound = (None, None, None)
        for x in [*jax.tree.leaves(params), *cached]:
            if isinstance(x, jax.Array) and not x.is_deleted():
                x.delete()


def _refillable(old: Any, host: Any) -> bool:
    """Whether a swap can write ``host`` into ``old``'s buffer in place (same shape and dtype, live)."""
    return (isinstance(old, jax.Array) and not old.is_deleted() and old.ndim >= 1
            and tuple(np.shape(host)) == old.shape and np.dtype(getattr(host, "dtype", None)) == old.dtype)
