"""A LoRA run's serving side: each rollout server holds the base once and takes adapter versions.

With ``learner.lora`` on, a published version carries only adapters and the base's identity
(model/lora_version.py). The base itself is written once, beside the versions, to its own store
(``base_store``: the weight store's URL + '/lora_base', version 0) and never collected; a server
loads it once (``ServedBase``, in the serving dtype, on the host: pristine) and turns each adapter
version into what it swaps to (``lora_params_from_flat``): streamed servers get the base with the
adapters merged in layer by layer at the swap (HostWeights.lora), servers sharing one placed copy
get the base placed once and a merged copy of the targeted leaves per version. A version whose
base identity is not the server's base is refused, naming both.
"""

from __future__ import annotations

import threading

import numpy as np
from typing import Any, Callable

BASE_SUFFIX = "lora_base"


class ServedBase:
    """The base weights a server merges adapters into: host arrays shaped like the engine's params
    (``template``), in the serving dtype, never modified; ``id`` names them (base_identity of the
    flat base as published)."""

    def __init__(self, flat: dict, template: Any, dtype: Any = None):
        from laminar_jax.model.lora_version import base_identity
        from laminar_jax.model.precision import cast_floating
        from laminar_jax.weights.host import host_params

        if dtype is not None:
            from laminar_jax.model.precision import check_served_dtype

            check_served_dtype(flat, dtype, "LoRA base")
        self.id = base_identity(flat)
        tree = host_params(flat, template)
        self.tree = cast_floating(tree, dtype) if dtype is not None else tree
        self._lock = threading.Lock()
        self._placed: dict[Any, Any] = {}  # placement function -> the base placed by it

    def delta(self, flat: dict, where: str = "adapter version"):
        """The LoraDelta of an adapter version of this base; another base's is refused (BaseMismatchError)."""
        from laminar_jax.model.lora_version import check_base, is_adapter_version, read_adapter_version
        from laminar_jax.rollout.lora_merge import LoraDelta

        if not is_adapter_version(flat):
            raise ValueError(f"{where}: a full weight version (no 'lora.base_sha256'), but this server serves "
                             f"LoRA adapters over base {self.id} (learner.lora is on)")
        v = read_adapter_version(flat, where)
        check_base(v.base_id, self.id, where)
        return LoraDelta(v.scale, v.pairs)

    def placed(self, place: Callable[[Any], Any]) -> Any:
        """The base placed by ``place`` (once per placement function)."""
        with self._lock:
            if place not in self._placed:
                self._placed[place] = place(self.tree)
            return self._placed[place]


def lora_params_from_flat(base: ServedBase, engine=None, stream: bool = True) -> Callable[[dict], Any]:
    """flat adapter version -> what a server swaps to (fleet.params_from_flat's LoRA form)."""
    import jax

    from laminar_jax.rollout.lora_merge import merged_tree
    from laminar_jax.rollout.server import HostWeights

    if stream:
        return lambda flat: HostWeights(base.tree, lora=base.delta(flat))
    place = jax.device_put if engine is None or engine.mesh is None else engine.placement.place
    return lambda flat: merged_tree(base.placed(place), base.delta(flat))


def base_store_url(store_url: str) -> str:
    return store_url.rstrip("/") + "/" + BASE_SUFFIX


def write_base(rcfg, store_url: str, flat: dict, base_id: str) -> None:
    """Put the base (flat, as published) in its own store once; a store that holds another base is
    an error naming both identities (a resumed run must train on the base it started from)."""
    from laminar_jax.model.lora_version import base_identity, check_base
    from laminar_jax.relay import WeightStore

    store = WeightStore.from_config(rcfg, base_store_url(store_url))
    if store.newest_committed() is None:
        store.write(0, flat)
        return
    check_base(base_identity(store.read(0)), base_id, f"LoRA base store {store.url}")


def adopt_base(learner, rcfg, store_url: str) -> bool:
    """A resumed LoRA learner takes the run's base from its base store: the frozen base is not
    checkpointed, and the rebuilt one can differ (a resumed run skips the supervised warm-up that
    made the base). False when the store holds no base yet (a fresh run). In a multi-process
    learner every process reads the store and places its own shards (no collective)."""
    import jax

    from laminar_jax.learner.publish import unflatten_params
    from laminar_jax.model.lora_version import base_identity
    from laminar_jax.relay import WeightStore

    store = WeightStore.from_config(rcfg, base_store_url(store_url))
    if store.newest_committed() is None:
        return False
    flat = store.read(0)
    frozen = learner.state.frozen["actor"]
    host = unflatten_params(flat, frozen, drop=())

    def place(h, x):
        h = np.asarray(h, x.dtype)
        return jax.make_array_from_callback(h.shape, x.sharding, lambda index: h[index])

    placed = jax.tree.map(place, host, frozen)
    learner.state = learner.state._replace(frozen={**learner.state.frozen, "actor": placed})
    learner.lora.set_base_id(base_identity(flat))
    return True


def share_base(learner, rcfg, store_url: str, adopt: bool, write: bool) -> str:
    """Collective in a multi-process learner (every process calls it, in the same order): the run's
    base in its store, and its identity known to every process. ``adopt``: take the store's base
    when it holds one (a resume, `adopt_base`); else the frozen base is gathered to process 0 once
    (learner/gather.py), which hashes it and, with ``write``, puts it in the store (`write_base`);
    the identity is then broadcast (32 bytes). Returns the base's identity."""
    from laminar_jax.learner.gather import gather_to_root
    from laminar_jax.learner.publish import base_of, flatten_params
    from laminar_jax.model.lora_version import base_identity

    if adopt and adopt_base(learner, rcfg, store_url):
        return learner.lora.base_id
    host = gather_to_root(base_of(flatten_params(learner.state.frozen["actor"])))  # None on processes > 0
    base_id = None if host is None else base_identity(host)
    if write and host is not None:
        write_base(rcfg, store_url, host, base_id)
    del host
    base_id = _broadcast_hex(base_id)
    learner.lora.set_base_id(base_id)
    return base_id


def _broadcast_hex(digest) -> str:
    """Process 0's hex SHA-256 on every process (a one-array broadcast; as is in one process)."""
    import jax

    if jax.process_count() == 1:
        return digest
    from jax.experimental import multihost_utils

    raw = np.frombuffer(bytes.fromhex(digest), np.uint8) if digest is not None else np.zeros(32, np.uint8)
    return bytes(np.asarray(multihost_utils.broadcast_one_to_all(raw), np.uint8)).hex()


def read_base(rcfg, store_url: str, template: Any, dtype: Any = None) -> ServedBase:
    """A server's base, read from the run's base store."""
    from laminar_jax.relay import WeightStore

    store = WeightStore.from_config(rcfg, base_store_url(store_url))
    if store.newest_committed() is None:
        raise FileNotFoundError(f"learner.lora: no base in {store.url} (the learner writes it when the run starts)")
    return ServedBase(store.read(0), template, dtype)


def merged_flat(rcfg, store_url: str, flat: dict) -> dict:
    """An adapter version merged into the run's base (from its base store), flat on the host, in the
    base's dtype: the full weights of that version (export)."""
    from laminar_jax.model.lora import merge_params
    from laminar_jax.model.lora_version import base_identity, check_base, read_adapter_version
    from laminar_jax.relay import WeightStore

    store = WeightStore.from_config(rcfg, base_store_url(store_url))
    if store.newest_committed() is None:
        raise FileNotFoundError(f"learner.lora: no base in {store.url} to merge the adapter version into")
    base = store.read(0)
    v = read_adapter_version(flat, "stored adapter version")
    check_base(v.base_id, base_identity(base), "stored adapter version")
    adapters = {n: x for n, x in flat.items() if n.endswith((".lora_a", ".lora_b"))}
    return merge_params(base, adapters, v.scale)


__all__ = ["ServedBase", "lora_params_from_flat", "base_store_url", "write_base", "read_base", "adopt_base",
           "share_base"]
