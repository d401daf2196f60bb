"""The layers as one scan over stacked parameters, against a per-layer reference.

A tiny checkpoint made by transformers is imported (per-layer HF tensors -> the stacked layout),
its logits and gradients through the scan (every remat policy) are compared with a Python loop
over the same layers, each layer's parameters sliced out of the stack, and the export writes the
checkpoint's own tensors back. Tolerances: float32 on CPU, only XLA's fusion order differs.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from laminar_jax.learner.mesh import param_shardings
from laminar_jax.model import from_pretrained, save_pretrained
from laminar_jax.model.transformer import REMAT_POLICIES, rope_inv_freq
from tests.model.hf_fixtures import COMMON, save_hf_model

LAYERS = 3


def _unrolled_logits(model, tokens, positions, segment_ids):
    """The reference: one layer after another in a Python loop, layer l's parameters = the stack's [l]."""
    graphdef, state = nnx.split(model.layers)
    inv_freq = jnp.asarray(rope_inv_freq(model.cfg))
    x = model.embed_tokens(tokens)
    for i in range(model.cfg.num_layers):
        layer = nnx.merge(graphdef, jax.tree.map(lambda a: a[i], state))
        x, _ = layer(x, positions, inv_freq, segment_ids)
    return model.logits_from_hidden(model.norm(x))


@pytest.fixture(scope="module", params=["qwen2", "qwen3"])
def imported(request, tmp_path_factory):
    """(family, checkpoint dir, the imported model) of a 3-layer checkpoint written by transformers."""
    import tests.model.hf_fixtures as fx

    path = str(tmp_path_factory.mktemp(request.param))
    old = dict(fx.COMMON)
    fx.COMMON["num_hidden_layers"] = LAYERS
    try:
        save_hf_model(request.param, path)
    finally:
        fx.COMMON.clear()
        fx.COMMON.update(old)
    return request.param, path, from_pretrained(path)


def test_import_stacks_every_layer(imported):
    _, path, model = imported
    q = np.asarray(model.layers.self_attn.q_proj.weight[...])
    assert q.shape[0] == LAYERS
    tensors = load_file(os.path.join(path, "model.safetensors"))
    for i in range(LAYERS):
        np.testing.assert_array_equal(q[i], tensors[f"model.layers.{i}.self_attn.q_proj.weight"])


def test_export_writes_the_checkpoint_back(imported, tmp_path):
    _, path, model = imported
    save_pretrained(model, str(tmp_path))
    ours, theirs = (load_file(os.path.join(p, "model.safetensors")) for p in (str(tmp_path), path))
    assert sorted(ours) == sorted(theirs)
    assert sum(k.startswith(f"model.layers.{LAYERS - 1}.") for k in ours) >= 9
    for name in theirs:
        np.testing.assert_array_equal(ours[name], theirs[name], err_msg=name)


@pytest.mark.parametrize("remat", REMAT_POLICIES)
def test_scan_matches_per_layer_reference(imported, remat):
    _, _, model = imported
    graphdef, params = nnx.split(model)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(3, COMMON["vocab_size"], (2, 11)), jnp.int32)
    seg = jnp.asarray([[1] * 6 + [2] * 5, [1] * 7 + [0] * 4], jnp.int32)  # packed and padded rows
    pos = jnp.asarray([list(range(6)) + list(range(5)), list(range(7)) + [0] * 4], jnp.int32)
    weights = jnp.asarray(rng.normal(size=(2, 11, COMMON["vocab_size"])), jnp.float32)

    def scanned(p):
        logits = nnx.merge(graphdef, p).forward(tokens, pos, seg, remat=remat).logits
        return jnp.mean(logits * weights), logits

    def unrolled(p):
        logits = _unrolled_logits(nnx.merge(graphdef, p), tokens, pos, seg)
        return jnp.mean(logits * weights), logits

    (l1, out1), g1 = jax.jit(jax.value_and_grad(scanned, has_aux=True))(params)
    (l0, out0), g0 = jax.jit(jax.value_and_grad(unrolled, has_aux=True))(params)
    np.testing.assert_allclose(np.asarray(out1), np.asarray(out0), rtol=0, atol=2e-6)
    np.testing.assert_allclose(float(l1), float(l0), rtol=1e-6, atol=1e-7)
    flat0, flat1 = jax.tree.leaves(g0), jax.tree.leaves(g1)
    assert len(flat0) == len(flat1)
    for a, b in zip(flat0, flat1):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=0, atol=2e-6)
    last = np.asarray(g1["layers"]["mlp"]["down_proj"]["weight"][...])
    assert last.shape[0] == LAYERS and all(np.abs(last[i]).max() > 1e-4 for i in range(LAYERS))  # every layer trained


def test_layer_axis_is_never_sharded(imported):
    """The stacked axis carries logical axis None: a mesh rule never splits it (learner and TP meshes)."""
    _, _, model = imported
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("fsdp",))
    state = nnx.state(model.layers)
    for var in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, nnx.Variable)):
        assert var.get_metadata()["out_sharding"][0] is None
    specs = jax.tree.leaves(param_shardings(state, mesh, ("embed=fsdp", "mlp=fsdp", "heads=fsdp")),
                            is_leaf=lambda x: isinstance(x, jax.sharding.NamedSharding))
    assert specs and all(s.spec[0] is None for s in specs)
