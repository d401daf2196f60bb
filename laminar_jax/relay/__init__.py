"""Relay plane: versioned weight store, learner-side publisher, relay workers, rollout-side client.

Weights travel as a flat ``dict[str, np.ndarray]`` (name -> host array). Names come from
``flatten_tree`` (``laminar_jax.naming``: each leaf's path with dots; an already-flat dict keeps its keys).

Interfaces (import from here or from the named module):

- ``flat.flatten_tree(pytree) -> dict[str, np.ndarray]`` and
  ``flat.unflatten_like(flat, template_pytree, strict=True) -> pytree``.
- ``store.WeightStore(url_or_path, keep_last=3, format="packed"|"zarr3"|"zarr3_ocdbt", verify=True)``:
  ``.write(version, flat) -> Manifest`` (atomic: manifest, then ``LATEST``), ``.latest() -> int|None``,
  ``.versions() -> list[int]``, ``.newest_committed() -> int|None`` (from the manifests, the writer's
  view; ``latest()`` may trail it by one commit after a writer died), ``.read(version, names=None) -> flat``,
  ``.manifest(version)``,
  ``.lease(version, holder, ttl_s=None) -> Lease`` (context manager; ``renew()``, ``release()``),
  ``.gc() -> GcReport``. Missing versions raise ``VersionNotFound``.
- ``publisher.Publisher(config, store=None, relay_addresses=None)``: ``.publish(version, params) -> stall_s``
  (returns once the host copy is taken; read-only host arrays such as ``np.asarray(jax.Array)`` are
  taken by reference, writeable ones copied), ``.flush(timeout)``, ``.close()``, ``.check()``, ``.stats()``.
- ``manifest.choose_chunk_bytes(total, max_chunk, min_chunk, link_rate, chunk_time_s, pipeline_chunks)``
  (pure) and ``publisher.chunk_bytes_for(config, total)``: the chunk size a version is cut into on
  relay links (about one ``chunk_time_s`` per link on rate-limited links, >= ``pipeline_chunks`` chunks).
- ``server.RelayServer(config, successors=(), port=None)``: ``.start()``, ``.stop()``, ``.address``,
  ``.versions_held()``, ``.set_successors(addresses)``, ``.check()``, ``.stats()``.
- ``client.RelayClient(addresses, store=None, config=RelaySection())``:
  ``.pull(newer_than=-1, timeout=60, shardings=None, like=None) -> (version, params)`` (local relay,
  then other relays, then the store; ``TimeoutError`` names what it waited for),
  ``.latest_version(timeout)``, ``.wait_for(version, timeout, address=None)``.
- ``chain.start_local_chain(n, config) -> LocalChain`` (``.addresses``, ``.kill(i)``, ``.stop()``):
  n ``python -m laminar_jax.relay.worker`` processes, relay i forwarding to relays i+1, i+2, ...
- ``config.RelaySection``: the plane's config section.
- ``laminar_jax.net.auth.run_keys(run_dir) -> RunKeys``: the run's link key (``relay.key``) and the learner's Ed25519
  keypair (``learner.key``, ``learner.pub``), all 0600, reused on resume. Pass it as ``keys=`` to
  Publisher, and ``keys.for_hosts()`` (no private key) to RelayServer, RelayClient and
  ``start_local_chain``: connections are then authenticated (HMAC per frame, nonces against replay)
  and versions and chunks signed by the learner alone.

Nothing here imports jax at import time; relay worker processes never do.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "RelaySection": "config", "flatten_tree": "flat", "unflatten_like": "flat", "tree_items": "flat",
    "WeightStore": "store", "VersionNotFound": "store", "Lease": "store", "GcReport": "store",
    "Manifest": "manifest", "ManifestError": "manifest", "Publisher": "publisher",
    "PublisherStats": "publisher", "RelayServer": "server", "RelayClient": "client",
    "start_local_chain": "chain", "LocalChain": "chain", "TokenBucket": "ratelimit",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
