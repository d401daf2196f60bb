"""Models built abstractly and filled straight onto their shardings: no device ever holds a whole
unsharded model on the way.

  abstract_model(section)            the Transformer with ShapeDtypeStruct leaves (nnx.eval_shape):
                                     shapes, dtypes and logical axes, no memory
  load_model(section, shardings)     the same module with every parameter a jax.Array on its
                                     sharding: an HF checkpoint is read tensor by tensor, and each
                                     device's callback reads only its own slice of the file
                                     (safetensors get_slice, jax.make_array_from_callback); a
                                     preset is initialised under jit with those out_shardings

``shardings`` is a function (state path, abstract leaf) -> jax.sharding.Sharding, or None for
the default device. The role that needs the weights supplies it (the learner's mesh shardings,
a rollout server's TP layout); the model plane never knows which.
"""

from __future__ import annotations

import json
import os
from typing import Callable, Optional

import jax
import numpy as np
from flax import nnx

from laminar_jax.model.hf import (_IGNORED_SUFFIXES, _TensorIndex, MissingTensorError, _as_dtype, _flat_items,
                                  _set_path, hf_name, is_stacked, load_hf_config, log)
from laminar_jax.model.presets import PRESETS
from laminar_jax.model.transformer import Transformer

ShardingOf = Callable[[tuple, jax.ShapeDtypeStruct], jax.sharding.Sharding]
# safetensors dtype names of the floating tensors a checkpoint may hold -> config.json torch_dtype names.
_ST_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


class CheckpointMismatchError(ValueError):
    """A checkpoint tensor whose shape or dtype does not match the model's config."""


def model_config(section):
    """The TransformerConfig of a ModelSection (config.json of ``path``, else the preset)."""
    return load_hf_config(section.path) if section.path else PRESETS[section.preset]


def _build(section, cfg=None) -> Transformer:
    return Transformer(cfg or model_config(section), rngs=nnx.Rngs(section.seed), dtype=_as_dtype(section.dtype),
                       param_dtype=_as_dtype(section.param_dtype), value_head=section.value_head)


def abstract_model(section) -> Transformer:
    """The section's model with abstract leaves (jax.ShapeDtypeStruct): its graph, config, shapes,
    dtypes and logical axes, and no parameter memory anywhere."""
    cfg = model_config(section)
    return nnx.eval_shape(lambda: _build(section, cfg))


def param_bytes(model) -> int:
    """Bytes of every parameter of a model, abstract or concrete."""
    return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(nnx.state(model)))


def _default_sharding(path: tuple, leaf) -> jax.sharding.Sharding:
    return jax.sharding.SingleDeviceSharding(jax.devices()[0])


def load_model(section, shardings: Optional[ShardingOf] = None,
               on_read: Optional[Callable[[str, tuple, int], None]] = None) -> Transformer:
    """The section's model with every parameter placed on ``shardings(path, abstract_leaf)``.

    on_read(tensor name, index, nbytes) is called for every slice read from a checkpoint (tests
    check that a device's callback reads its shard only).
    """
    shardings = shardings or _default_sharding
    abstract = abstract_model(section)
    graphdef, state = nnx.split(abstract)
    pure = nnx.to_pure_dict(state)
    target = {p: shardings(p, leaf) for p, leaf in _flat_items(pure)}
    if section.path:
        missing = _fill_from_checkpoint(section.path, pure, target, on_read)
    else:
        missing = [p for p, _ in _flat_items(pure)]
    if missing:  # a preset, or a value head the checkpoint lacks: initialised from the seed
        _fill_from_init(section, abstract.cfg, pure, target, missing)
    nnx.replace_by_pure_dict(state, pure)
    return nnx.merge(graphdef, state)


def _fill_from_init(section, cfg, pure: dict, target: dict, paths: list) -> None:
    """Initialise ``paths`` from the seed in one program whose outputs are those leaves on their
    shardings: each device computes its own shards (threefry is partitionable), unused ones are
    dropped by the compiler."""
    def init():
        full = nnx.to_pure_dict(nnx.state(_build(section, cfg)))
        out = {}
        for p in paths:
            node = full
            for k in p:
                node = node[k]
            out[p] = node
        return out

    devices = {d for p in paths for d in target[p].device_set}
    if len(devices) == 1:  # one device: built there eagerly, the values every unsharded build gets
        with jax.default_device(devices.pop()):
            values = init()
    else:  # equal to the eager values up to float rounding (the compiler fuses the scaling into the draw)
        values = jax.jit(init, out_shardings={p: target[p] for p in paths})()
    for p in paths:
        _set_path(pure, p, values[p])


def _config_dtype(path: str) -> Optional[str]:
    with open(os.path.join(path, "config.json")) as f:
        d = json.load(f).get("torch_dtype")
    return d if d in _ST_DTYPES.values() else None


def _fill_from_checkpoint(path: str, pure: dict, target: dict, on_read) -> list:
    """Every leaf of ``pure`` read from the checkpoint onto its sharding; returns the paths of a
    value head the checkpoint does not hold (initialised by the caller)."""
    index = _TensorIndex(path)
    config_dtype = _config_dtype(path)
    missing = []
    try:
        used = set()
        for p, leaf in list(_flat_items(pure)):
            names = [hf_name(p, i) for i in range(leaf.shape[0])] if is_stacked(p) else [hf_name(p)]
            used.update(names)
            if p[0] == "value_head" and names[0] not in index.where:
                missing.append(p)
                continue
            _set_path(pure, p, _read_tensor(index, names, leaf, target[p], config_dtype, on_read,
                                                  is_stacked(p)))
        extra = [k for k in index.where if k not in used and not k.endswith(_IGNORED_SUFFIXES)]
        if extra:
            log.warning("%s: ignored %d tensors not used by the model, e.g. %s", path, len(extra), extra[:3])
    finally:
        index.close()
    return missing


def _read_tensor(index: _TensorIndex, names: list, leaf, sharding, config_dtype: Optional[str],
                 on_read, stacked: bool = False) -> jax.Array:
    """Checkpoint tensors onto ``sharding``, each device reading only its slice of the files: one
    tensor, or for a ``stacked`` parameter (leading layer axis) one per layer, ``names[l]`` at index l."""
    shape = tuple(leaf.shape[1:]) if stacked else tuple(leaf.shape)
    slices = [_checked_slice(index, name, shape, leaf.dtype, config_dtype) for name in names]

    def part(name, sl, idx: tuple) -> np.ndarray:
        x = np.asarray(sl[idx] if shape else sl[()]).astype(leaf.dtype)
        if on_read is not None:
            on_read(name, idx, x.nbytes)
        return x

    def read(idx: tuple) -> np.ndarray:
        if not stacked:
            return part(names[0], slices[0], idx)
        return np.stack([part(names[i], slices[i], idx[1:]) for i in range(len(names))[idx[0]]])

    return jax.make_array_from_callback(tuple(leaf.shape), sharding, read)


def _checked_slice(index: _TensorIndex, name: str, shape: tuple, dtype, config_dtype: Optional[str]):
    """The tensor's lazy slice, after checking its shape and dtype against the parameter's."""
    sl = index.get_slice(name)
    got, st_dtype = tuple(sl.get_shape()), sl.get_dtype()
    where = f"{index.path}: tensor {name!r}"
    if got != shape:
        raise CheckpointMismatchError(f"{where} has shape {got}, the config expects {shape}")
    if st_dtype not in _ST_DTYPES:
        raise CheckpointMismatchError(f"{where} has dtype {st_dtype}, expected a floating dtype "
                                      f"({'/'.join(_ST_DTYPES)}) for a {shape} {dtype} parameter")
    if config_dtype is not None and _ST_DTYPES[st_dtype] != config_dtype:
        raise CheckpointMismatchError(f"{where} has dtype {_ST_DTYPES[st_dtype]} (shape {got}), config.json says "
                                      f"torch_dtype={config_dtype} (shape {shape} expected)")
    return sl


__all__ = ["CheckpointMismatchError", "MissingTensorError", "abstract_model", "load_model", "model_config",
           "param_bytes"]
