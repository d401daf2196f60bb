"""Load an HF directory onto a learner mesh and a rollout TP mesh of fake CPU devices; check that
every device holds only its shards and that no read materialised more than one device's slice.

Run with XLA_FLAGS=--xla_force_host_platform_device_count=8 (tests/model/test_sharded_load.py).
argv: the HF directory.
"""

import gc
import sys

import jax
import numpy as np
from safetensors import safe_open

from laminar_jax.learner.config import MeshSection
from laminar_jax.learner.mesh import build_mesh, sharding_of
from laminar_jax.model.config import ModelSection
from laminar_jax.model.hf import _flat_items, hf_name, is_stacked
from laminar_jax.model.sharded import abstract_model, load_model, param_bytes
from laminar_jax.rollout.tp import TP_RULES, tp_mesh
from flax import nnx


def live_per_device() -> dict:
    out: dict = {}
    for a in jax.live_arrays():
        if a.is_deleted():
            continue
        nbytes = int(np.prod(a.sharding.shard_shape(a.shape))) * a.dtype.itemsize
        for d in a.sharding.device_set:
            out[d.id] = out.get(d.id, 0) + nbytes
    return out


def check(path: str, mesh, rules, devices) -> None:
    gc.collect()
    base = live_per_device()  # what an earlier check left (freed or not)
    section = ModelSection(path=path)
    abstract = abstract_model(section)
    shardings = sharding_of(abstract, mesh, rules)
    reads: list = []
    peak: dict = {}

    def on_read(name, idx, nbytes):
        reads.append((name, nbytes))
        for d, b in live_per_device().items():
            peak[d] = max(peak.get(d, 0), b)

    model = load_model(section, shardings, on_read=on_read)
    final = live_per_device()  # before reading shard.data below (each read makes an array of its own)
    total = param_bytes(model)
    f = {}
    pure = nnx.to_pure_dict(nnx.state(model))
    shard_bytes, sharded = {}, 0
    for p, x in _flat_items(pure):
        # A stacked parameter (leading layer axis) holds one file tensor per layer, read layer by layer.
        names = [hf_name(p, i) for i in range(x.shape[0])] if is_stacked(p) else [hf_name(p)]
        name = names[0]
        file = f"{path}/model.safetensors"
        if file not in f:
            f[file] = safe_open(file, framework="numpy")
        full = np.stack([f[file].get_tensor(n) for n in names]) if is_stacked(p) else f[file].get_tensor(name)
        assert x.sharding == shardings(p, None), name
        shape = x.sharding.shard_shape(x.shape)
        for s in x.addressable_shards:  # each device holds exactly its shard, with the file's values
            assert s.data.shape == shape, (name, s.data.shape, shape)
            np.testing.assert_array_equal(np.asarray(s.data), full[s.index])
        for n in names:
            shard_bytes[n] = int(np.prod(shape)) * 4 // len(names) if is_stacked(p) else int(np.prod(shape)) * 4
        if np.prod(shape) < full.size:
            sharded += len(names)
    assert sharded >= 8, f"only {sharded} tensors sharded: the mesh does not exercise the loader"
    for name, nbytes in reads:  # every read was one device's slice, never a whole sharded tensor
        assert nbytes <= shard_bytes[name], (name, nbytes, shard_bytes[name])
    for d in devices:
        held = final[d.id] - base.get(d.id, 0)
        # The device never held more than its final shards during the load (no whole copy passed by).
        assert peak.get(d.id, 0) - base.get(d.id, 0) <= held, (d.id, peak.get(d.id), final[d.id])
        assert held < total, (d.id, held, total)
    print(f"ok {len(devices)} devices: {total} model bytes, per device {sorted({final[d.id] - base.get(d.id, 0) for d in devices})}, "
          f"{len(reads)} reads, {sharded} sharded tensors")
    del model


def main() -> None:
    path = sys.argv[1]
    assert jax.device_count() == 8, jax.devices()
    check(path, build_mesh(MeshSection(data=1, fsdp=4, tensor=2)), MeshSection().rules, jax.devices())
    tp = tp_mesh(jax.devices()[2:4])
    check(path, tp, TP_RULES, jax.devices()[2:4])


if __name__ == "__main__":
    main()
