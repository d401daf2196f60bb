"""Per-layer rematerialization in the training forward: same values and gradients, fewer residuals.

Tolerances (float32, CPU): logits/values atol 1e-6 (|logit| ~ 0.3); gradients atol 1e-6 with the
largest |g| ~ 1e-1 (only XLA's fusion/reduction order differs between the programs).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from laminar_jax.model import PRESETS, Transformer
from laminar_jax.model.arch import TransformerConfig
from laminar_jax.model.transformer import REMAT_POLICIES

# Untied lm_head, biases and q/k norm: every parameter kind goes through the rematerialized layers.
CFG = TransformerConfig(model_type="qwen3", vocab_size=97, hidden_size=48, intermediate_size=96, num_layers=2,
                        num_heads=4, num_kv_heads=2, head_dim=12, qkv_bias=True, qk_norm=True,
                        tie_word_embeddings=False, max_position_embeddings=64)


def _setup():
    model = Transformer(CFG, rngs=nnx.Rngs(0), value_head=True)
    graphdef, params = nnx.split(model)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(3, 97, (2, 11)), jnp.int32)
    seg = jnp.asarray([[1] * 11, [1] * 7 + [0] * 4], jnp.int32)  # a padded row
    pos = jnp.asarray([list(range(11)), list(range(7)) + [0] * 4], jnp.int32)
    weights = jnp.asarray(rng.normal(size=(2, 11, 97)), jnp.float32)

    def loss(p, remat):
        out = nnx.merge(graphdef, p).forward(tokens, pos, seg, remat=remat)
        return jnp.mean(out.logits * weights) + jnp.mean(out.values ** 2), out

    return params, loss


def _per_layer(grads) -> list:
    """Every gradient tensor, a stacked layer parameter's split into one per layer (as HF names them)."""
    pure = nnx.to_pure_dict(grads)
    out = [x for k, v in pure.items() if k != "layers" for x in jax.tree.leaves(v)]
    return out + [x[i] for x in jax.tree.leaves(pure["layers"]) for i in range(x.shape[0])]


@pytest.fixture(scope="module")
def reference():
    params, loss = _setup()
    vg = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)
    return params, vg, vg(params, "none")


@pytest.mark.parametrize("remat", [r for r in REMAT_POLICIES if r != "none"])
def test_remat_matches_no_remat(reference, remat):
    params, vg, ((l0, out0), g0) = reference
    (l1, out1), g1 = vg(params, remat)
    np.testing.assert_allclose(np.asarray(out1.logits), np.asarray(out0.logits), rtol=0, atol=1e-6)
    np.testing.assert_allclose(np.asarray(out1.values), np.asarray(out0.values), rtol=0, atol=1e-6)
    np.testing.assert_allclose(float(l1), float(l0), rtol=1e-6, atol=1e-7)
    leaves0, leaves1 = _per_layer(g0), _per_layer(g1)
    assert len(leaves0) == len(leaves1) > 20
    for a, b in zip(leaves0, leaves1):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=0, atol=1e-6)
    assert max(float(jnp.abs(a).max()) for a in leaves0) > 1e-2  # a real gradient


def _residual_bytes(f, params) -> int:
    """Bytes the backward pass keeps from the forward: the array leaves of jax.vjp's closure
    (shapes only, via eval_shape; the weights the backward reads count the same in every variant)."""
    shapes = jax.eval_shape(lambda p: [x for x in jax.tree.leaves(jax.vjp(f, p)[1])], params)
    return sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in shapes)


def test_remat_keeps_fewer_activations():
    params, loss = _setup()
    none = _residual_bytes(lambda p: loss(p, "none")[0], params)
    full = _residual_bytes(lambda p: loss(p, "full")[0], params)
    dots = _residual_bytes(lambda p: loss(p, "dots_with_no_batch_dims_saveable")[0], params)
    assert full < dots < none, (full, dots, none)


def test_bad_remat_name_and_default_path_unchanged():
    model = Transformer(PRESETS["tiny"], rngs=nnx.Rngs(0))
    tokens = jnp.ones((1, 4), jnp.int32)
    with pytest.raises(ValueError, match="remat='bogus'"):
        jax.eval_shape(lambda: model.forward(tokens, remat="bogus"))
    graphdef, params = nnx.split(model)

    @jax.jit
    def both(p):
        m = nnx.merge(graphdef, p)
        out = m.forward(tokens, with_logits=False)
        assert out.logits is None
        return m.logits_from_hidden(out.hidden), m(tokens)

    split, full = both(params)
    np.testing.assert_array_equal(np.asarray(split), np.asarray(full))
