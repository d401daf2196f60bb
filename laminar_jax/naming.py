"""Weights as flat dicts: the one naming of pytree leaves, and the one way to start host copies.

Used by every plane that moves weights (the learner publishes, the relay plane stores and serves,
rollout servers and exports load): a leaf is named by its path with dots, `layers.0.attn.q_proj.weight`
(dict keys and attribute names as they are, sequence indices as numbers; nnx's `.value` wrapper
is skipped). Names are deterministic (jax orders dict keys) and the same in every process.
"""

from __future__ import annotations

import functools
from typing import Any


def path_name(path) -> str:
    """A jax key path as a dotted name ('<root>' for a bare leaf)."""
    import jax

    names = []
    for k in path:
        if isinstance(k, jax.tree_util.DictKey):
            names.append(str(k.key))
        elif isinstance(k, jax.tree_util.SequenceKey):
            names.append(str(k.idx))
        elif isinstance(k, jax.tree_util.GetAttrKey) and k.name != "value":
            names.append(k.name)
        elif isinstance(k, jax.tree_util.FlattenedIndexKey):
            names.append(str(k.key))
    return ".".join(names) or "<root>"


def named_leaves(pytree: Any) -> list[tuple[str, Any]]:
    """[(dotted name, leaf)] in jax flattening order; a name that occurs twice is an error."""
    import jax

    out, seen = [], set()
    for path, leaf in jax.tree_util.tree_flatten_with_path(pytree)[0]:
        name = path_name(path)
        if name in seen:
            raise ValueError(f"pytree leaf name {name!r} occurs twice; names must be unique")
        seen.add(name)
        out.append((name, leaf))
    return out


def start_host_copies(leaves: list[Any]) -> list[Any]:
    """Start device-to-host copies of every jax array so they overlap each other; returns the leaves
    to read the host values from (``np.asarray`` of one waits for its copy only).

    Device arrays go to their devices' pinned host memory where they have it: a DMA at the link's
    speed, where a ``copy_to_host_async`` into unpinned memory is staged by the host through
    pageable memory, many times slower (`pinned_host_sharding`). Elsewhere the copies are
    started in place. Arrays on the CPU backend, or already in host memory, are returned as they
    are: ``np.asarray`` of one is a zero-copy view, so a copy there is pure overhead (about half of
    ``jax.device_get``'s time on CPU).
    """
    import jax

    out = list(leaves)
    to_pin, shardings = [], []
    for i, leaf in enumerate(out):
        if isinstance(leaf, jax.Array) and leaf.is_fully_addressable and not _host_resident(leaf):
            pinned = pinned_host_sharding(leaf.sharding)
            if pinned is None:
                leaf.copy_to_host_async()
            else:
                to_pin.append(i)
                shardings.append(pinned)
    if to_pin:  # one asynchronous device_put for all of them
        for i, leaf in zip(to_pin, jax.device_put([out[i] for i in to_pin], shardings)):
            out[i] = leaf
    return out


def host_arrays(named: dict[str, Any]) -> dict[str, Any]:
    """{name: array} -> {name: host numpy array}, every device-to-host copy started before the first
    is awaited (`start_host_copies`); numpy values pass through as they are."""
    import numpy as np

    return {k: np.asarray(v) for k, v in zip(named, start_host_copies(list(named.values())))}


HOST_MEMORY_KINDS = ("pinned_host", "unpinned_host")


def _host_resident(x: Any) -> bool:
    """On the CPU backend, or already in host memory (a pinned-host snapshot): no copy to start."""
    try:
        return x.sharding.memory_kind in HOST_MEMORY_KINDS or all(d.platform == "cpu" for d in x.sharding.device_set)
    except (AttributeError, RuntimeError):  # deleted or unusual array: let the copy path decide
        return False


def pinned_host_sharding(sharding: Any) -> Any:
    """`sharding` placed in its devices' pinned host memory, or None where they have none.

    Why: a program that writes its outputs there moves them by DMA at the link's speed, where
    ``copy_to_host_async`` of device arrays into unpinned numpy memory is staged by the host, many
    times slower: for a 0.5B model's f32 weights, slower than a learner step, which then held every
    publishing step back."""
    if not all(_has_pinned_host(d) for d in sharding.device_set):
        return None
    return sharding.with_memory_kind("pinned_host")


@functools.lru_cache(maxsize=None)
def _has_pinned_host(device: Any) -> bool:
    # Asked per leaf of every publish (hundreds of leaves), and a device's memories do not change.
    return "pinned_host" in {m.kind for m in device.addressable_memories()}
