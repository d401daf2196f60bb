"""A LoRA weight version as published: the adapters and the identity of the base they apply to.

A LoRA learner publishes only its adapters: every tensor named '<module>.lora_a' / '<module>.lora_b'
(model/lora.py's names and shapes: adapters of '<module>.weight', stacked under the layers' scan as
it is), plus two small tensors: ``lora.base_sha256``
(uint8[32], the SHA-256 of the base the adapters were trained on, ``base_identity``) and
``lora.scale`` (float32[1], alpha / rank). They travel as ordinary tensors through every path of
the weight plane (host copy, store, relays, signatures, pulls), so a version's base identity is
stored, checksummed and signed with its adapters, and nothing in the relay plane knows LoRA.

A rollout server holds one base (loaded once, in the serving dtype) and its identity; an adapter
version of another base is refused (``check_base``), naming both identities.
"""

from __future__ import annotations

import hashlib
from typing import Mapping, NamedTuple

import numpy as np

from laminar_jax.model.lora import adapter_names, base_name

BASE_ID = "lora.base_sha256"
SCALE = "lora.scale"
SUFFIX_A, SUFFIX_B = ".lora_a", ".lora_b"


class BaseMismatchError(ValueError):
    """An adapter version trained on another base than the one a server holds."""


class AdapterVersion(NamedTuple):
    base_id: str  # hex SHA-256 of the base (base_identity)
    scale: float  # alpha / rank
    pairs: dict  # '<module>.weight' -> (lora_a, lora_b) host arrays


def _bytes(a) -> memoryview:
    return memoryview(np.ascontiguousarray(np.asarray(a)).reshape(-1).view(np.uint8))


def base_identity(flat: Mapping[str, np.ndarray]) -> str:
    """Hex SHA-256 of a flat weight dict: every tensor's name, dtype, shape and bytes, in name order.
    Computed over the base as published (the serving dtype, no value head), by the learner and by
    every server on what it loaded, so both name the same bytes the same way."""
    h = hashlib.sha256()
    for name in sorted(flat):
        a = np.asarray(flat[name])
        h.update(f"{name}|{a.dtype.name}|{tuple(a.shape)}\n".encode())
        h.update(_bytes(a))
    return h.hexdigest()


def is_adapter_version(flat: Mapping[str, np.ndarray]) -> bool:
    return BASE_ID in flat


def adapter_version(adapters: Mapping[str, np.ndarray], base_id: str, scale: float) -> dict:
    """The flat dict a LoRA learner publishes: its adapter tensors (names ending in '.lora_a' /
    '.lora_b') with the base's identity and the scale."""
    bad = [n for n in adapters if not n.endswith((SUFFIX_A, SUFFIX_B))]
    if bad:
        raise ValueError(f"adapter version: tensors {bad[:3]} are not adapters (names end in "
                         f"{SUFFIX_A!r} or {SUFFIX_B!r})")
    digest = bytes.fromhex(base_id)
    if len(digest) != 32:
        raise ValueError(f"adapter version: base identity {base_id!r} is not a hex SHA-256")
    return {**adapters, BASE_ID: np.frombuffer(digest, np.uint8).copy(),
            SCALE: np.asarray([scale], np.float32)}


def read_adapter_version(flat: Mapping[str, np.ndarray], where: str = "adapter version") -> AdapterVersion:
    """The parts of a published adapter version; an unpaired adapter or a tensor that is not an
    adapter is refused, naming it."""
    for key in (BASE_ID, SCALE):
        if key not in flat:
            raise ValueError(f"{where}: tensor {key!r} is missing (names: {sorted(flat)[:4]}...)")
    base_id = np.asarray(flat[BASE_ID]).astype(np.uint8).tobytes().hex()
    scale = float(np.asarray(flat[SCALE]).reshape(-1)[0])
    pairs = {}
    for name in flat:
        if name in (BASE_ID, SCALE):
            continue
        if not name.endswith((SUFFIX_A, SUFFIX_B)):
            raise ValueError(f"{where}: tensor {name!r} is not an adapter (a LoRA version carries only "
                             f"'<module>{SUFFIX_A}' / '<module>{SUFFIX_B}', {BASE_ID!r} and {SCALE!r})")
        param = base_name(name)
        a, b = adapter_names(param)
        if a not in flat or b not in flat:
            raise ValueError(f"{where}: {name!r} has no {(b if name == a else a)!r}")
        pairs[param] = (flat[a], flat[b])
    if not pairs:
        raise ValueError(f"{where}: no adapter tensors")
    return AdapterVersion(base_id, scale, pairs)


def check_base(version_base_id: str, server_base_id: str, where: str = "adapter version") -> None:
    """Refuse adapters trained on another base than the server's, naming both identities."""
    if version_base_id != server_base_id:
        raise BaseMismatchError(f"{where}: its base identity {version_base_id} differs from this server's base "
                                f"{server_base_id} (the adapters were trained on other base weights)")


__all__ = ["BASE_ID", "SCALE", "SUFFIX_A", "SUFFIX_B", "AdapterVersion", "BaseMismatchError", "base_identity",
           "is_adapter_version", "adapter_version", "read_adapter_version", "check_base"]
