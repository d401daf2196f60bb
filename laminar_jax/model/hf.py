"""Hugging Face checkpoint I/O: config.json + (sharded) *.safetensors <-> NNX Transformer.

Tensors are read lazily one at a time (safetensors memory-maps), each device reading only its own
slice, cast to the parameter dtype on the host (model/sharded.py); saving writes one tensor's host
copy at a time.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any, Iterable, Optional

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from laminar_jax.model.arch import TransformerConfig, from_hf_config, to_hf_config
from laminar_jax.model.transformer import Transformer

log = logging.getLogger(__name__)

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


class MissingTensorError(KeyError):
    pass


def _as_dtype(d: Any):
    return _DTYPES[d] if isinstance(d, str) else d


STACKED = "layers"  # the state's subtree whose parameters stack every layer's (model/transformer.py, stack_layers)


def is_stacked(path: tuple) -> bool:
    """Whether a state path names a stacked parameter (leading layer axis; one HF tensor per layer)."""
    return str(path[0]) == STACKED


def hf_name(path: tuple, layer: Optional[int] = None) -> str:
    """NNX state path -> HF tensor name; a stacked parameter's needs ``layer`` (its layer's tensor).
    Every tensor has HF's layout here too (Linear weights [out, in])."""
    if is_stacked(path):
        if layer is None:
            raise ValueError(f"hf_name: {path} is stacked over the layers; name one layer")
        path = (path[0], layer, *path[1:])
    parts = [str(p) for p in path]
    suffix = {"embedding": "weight", "weight": "weight", "bias": "bias"}[parts[-1]]
    stem = ".".join(parts[:-1])
    prefix = "" if parts[0] in ("lm_head", "value_head") else "model."
    return f"{prefix}{stem}.{suffix}"


def _flat_items(tree: dict, prefix: tuple = ()) -> Iterable[tuple[tuple, Any]]:
    for k, v in tree.items():
        if isinstance(v, dict):
            yield from _flat_items(v, prefix + (k,))
        else:
            yield prefix + (k,), v


def _set_path(tree: dict, path: tuple, value: Any) -> None:
    for k in path[:-1]:
        tree = tree[k]
    tree[path[-1]] = value


class _TensorIndex:
    """Name -> file for a directory of safetensors files (single or sharded)."""

    def __init__(self, path: str):
        self.path = path
        index_file = os.path.join(path, "model.safetensors.index.json")
        if os.path.exists(index_file):
            with open(index_file) as f:
                weight_map = json.load(f)["weight_map"]
            self.where = {k: os.path.join(path, v) for k, v in weight_map.items()}
        else:
            files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
            if not files:
                raise FileNotFoundError(f"{path}: no *.safetensors files found")
            self.where = {}
            for fn in files:
                with safe_open(os.path.join(path, fn), framework="numpy") as f:
                    for k in f.keys():
                        self.where[k] = os.path.join(path, fn)
        self._open: dict[str, Any] = {}

    def _file(self, name: str):
        file = self.where.get(name)
        if file is None:
            raise MissingTensorError(f"{self.path}: checkpoint has no tensor {name!r}")
        if file not in self._open:
            self._open[file] = safe_open(file, framework="numpy").__enter__()
        return self._open[file]

    def get(self, name: str) -> np.ndarray:
        return self._file(name).get_tensor(name)

    def get_slice(self, name: str):
        """The tensor's lazy slice handle: shape and dtype from the header, ``[index]`` reads that slice."""
        return self._file(name).get_slice(name)

    def close(self) -> None:
        for f in self._open.values():
            f.__exit__(None, None, None)
        self._open.clear()


def load_hf_config(path: str) -> TransformerConfig:
    cfg_file = os.path.join(path, "config.json")
    if not os.path.exists(cfg_file):
        raise FileNotFoundError(f"{path}: config.json not found (expected a Hugging Face model directory)")
    with open(cfg_file) as f:
        return from_hf_config(json.load(f), source=cfg_file)


def save_pretrained(model: Transformer, path: str, dtype: Optional[str] = None,
                    max_shard_bytes: int = 4 << 30, include_value_head: bool = False) -> None:
    """Write `model` as a HF directory that transformers / vLLM load as the same architecture."""
    os.makedirs(path, exist_ok=True)
    pure = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    tensors: dict[str, np.ndarray] = {}
    for p, leaf in _flat_items(pure):
        if p[0] == "value_head" and not include_value_head:
            continue
        arr = np.asarray(jax.device_get(leaf))
        if dtype is not None:
            arr = arr.astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype))
        for name, x in (((hf_name(p, i), arr[i]) for i in range(arr.shape[0])) if is_stacked(p)
                        else ((hf_name(p), arr),)):
            tensors[name] = np.ascontiguousarray(x)
    out_dtype = dtype or str(next(iter(tensors.values())).dtype)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(to_hf_config(model.cfg, torch_dtype=out_dtype), f, indent=2)
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name in sorted(tensors):
        nbytes = tensors[name].nbytes
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        fn = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(path, fn), metadata={"format": "pt"})
        weight_map.update({k: fn for k in shard})
    total = sum(t.nbytes for t in tensors.values())
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
