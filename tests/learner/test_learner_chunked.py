"""Chunked log-probs/entropy and layer remat in the learner == the unchunked, no-remat reference.

Reference: full logits from `model(tokens)` scored with `laminar_jax.model.token_logprobs` (the
engine's definition) and `losses.entropy_from_logits`. Tolerances (float32, CPU): log-probs and
entropy atol 1e-5 (values ~ -5 and ~ 4.8); loss rtol 1e-6; gradients atol 1e-6 with the largest
|g| ~ 1e-1. Only the matmul/reduction grouping differs between the programs.
"""

import dataclasses
import typing

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from laminar_jax.learner import LearnerSection
from laminar_jax.learner.batch import collate
from laminar_jax.learner.logprobs import chunk_positions, score_tokens
from laminar_jax.learner.losses import entropy_from_logits
from laminar_jax.learner.step import Graphs, make_grad_fn, make_prepare_fn
from laminar_jax.model import PRESETS, Transformer, token_logprobs
from laminar_jax.model.arch import TransformerConfig
from laminar_jax.model.attention import TRAIN_ATTENTION
from laminar_jax.model.transformer import REMAT_POLICIES
from laminar_jax.types import Trajectory

UNTIED = TransformerConfig(model_type="qwen2", vocab_size=97, hidden_size=32, intermediate_size=64, num_layers=2,
                           num_heads=4, num_kv_heads=2, head_dim=8, qkv_bias=True, tie_word_embeddings=False,
                           max_position_embeddings=64)


def test_chunk_positions():
    assert chunk_positions(0, 4, 100) == 100  # 0 = unchunked
    assert chunk_positions(1000, 4, 100) == 100  # fits in one chunk
    assert chunk_positions(100, 4, 100) == 25  # 25 positions x 4 rows = 100 tokens
    assert chunk_positions(120, 4, 100) == 25  # C0 = 30 -> 4 chunks -> 25 each, no padding
    assert chunk_positions(3, 8, 10) == 1  # never below one position
    c = chunk_positions(2048, 1, 18432)
    assert c <= 2048 and -(-18432 // c) * c - 18432 < -(-18432 // c)  # padding < number of chunks


@pytest.mark.parametrize("cfg", [PRESETS["tiny"], UNTIED], ids=["tied", "untied"])
def test_chunked_scores_match_token_logprobs(cfg):
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(3, cfg.vocab_size, (3, 23)), jnp.int32)
    targets = jnp.asarray(rng.integers(3, cfg.vocab_size, (3, 23)), jnp.int32)
    temperature = 0.7

    @jax.jit
    def run(p):
        m = nnx.merge(graphdef, p)
        logits = m(tokens)  # the engine's view: full logits
        ref = (token_logprobs(logits, targets, temperature), entropy_from_logits(logits / temperature))
        h = m.forward(tokens, with_logits=False).hidden
        got = [score_tokens(m.logits_from_hidden, h, targets, temperature, c, "value") for c in (1, 5, 8, 23, None)]
        return ref, got

    (ref_lp, ref_ent), got = run(params)
    assert float(ref_ent.min()) > 1.0  # a spread distribution, not a degenerate one
    for s in got:
        np.testing.assert_allclose(np.asarray(s.logp), np.asarray(ref_lp), rtol=0, atol=1e-5)
        np.testing.assert_allclose(np.asarray(s.entropy), np.asarray(ref_ent), rtol=0, atol=1e-5)


def _shapes_with(tree, dims):
    return [x.shape for x in jax.tree.leaves(tree) if all(d in x.shape for d in dims)]


def test_chunked_backward_keeps_no_full_logits():
    """The residuals the backward pass keeps: no f[B, T, V] array once the sequence is chunked."""
    cfg = UNTIED
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    tokens = jnp.ones((3, 23), jnp.int32)

    def loss(p, chunk):
        m = nnx.merge(graphdef, p)
        h = m.forward(tokens, with_logits=False).hidden
        return score_tokens(m.logits_from_hidden, h, tokens, 1.0, chunk, "grad").logp.sum()

    def residuals(chunk):
        return jax.eval_shape(lambda p: [x for x in jax.tree.leaves(jax.vjp(lambda q: loss(q, chunk), p)[1])],
                              params)

    assert _shapes_with(residuals(None), (23, cfg.vocab_size))  # unchunked keeps [B, T, V] arrays
    assert not _shapes_with(residuals(5), (23, cfg.vocab_size))
    assert not _shapes_with(residuals(5), (5, cfg.vocab_size))  # nor per-chunk logits across the scan


def _batch(n=8, group=4):
    rng = np.random.default_rng(1)
    out = []
    for i in range(n):
        r = rng.integers(3, 100, int(rng.integers(1, 20)))
        out.append(Trajectory(f"p{i // group}/{i % group}", f"p{i // group}", i % group, np.array([1, 5, 6]), r,
                              rng.normal(-4.8, 0.3, len(r)).astype(np.float32), 0, reward=float(rng.random())))
    return collate(out, buckets=(32,))


# Shared critic, KL in the loss, entropy bonus, decoupled off-policy (proximal log-probs in the
# prepare pass) and 2 micro-batches: every scored forward of the step goes through the new paths.
BASE = LearnerSection(lr=1e-3, critic="shared", adv_estimator="gae", kl_mode="loss", kl_coef=0.05,
                      entropy_coef=0.01, off_policy="decoupled", micro_batches=2, logits_chunk_tokens=0, remat="none")


@pytest.fixture(scope="module")
def reference():
    model = Transformer(PRESETS["tiny"], rngs=nnx.Rngs(0), value_head=True)
    graphdef, params = nnx.split(model)
    graphs = Graphs(graphdef, None, graphdef)
    params = {"actor": params}
    batch = jax.tree.map(jnp.asarray, _batch())

    def run(section):
        prepared = jax.jit(make_prepare_fn(section, graphs))(params, params["actor"], batch)
        grads, metrics = jax.jit(make_grad_fn(section, graphs))(params, prepared)
        return prepared, grads, metrics

    return run, run(BASE)


@pytest.mark.parametrize("chunk,remat,attention", [(12, "full", "dense"), (40, "dots_with_no_batch_dims_saveable", "dense"),
                                                   (12, "full", "chunked"), (12, "full", "flash")])
def test_step_chunked_and_remat_match_reference(reference, chunk, remat, attention):
    run, (prep0, g0, m0) = reference
    # 4 rows per micro-batch, T = 32: 12 tokens -> 3 positions per chunk (11 chunks, 1 padded), 40 -> 10
    # (4 chunks of 8). The prepare pass has 8 rows: 12 -> 1 position per chunk, 40 -> 5 (7 chunks).
    # attention='chunked'/'flash' with 8-token chunks/blocks: the 32-token rows run as 4 of them.
    prep1, g1, m1 = run(dataclasses.replace(BASE, logits_chunk_tokens=chunk, remat=remat, attention_impl=attention,
                                            attention_chunk=8))
    atol = 1e-6 if attention == "dense" else 1e-5  # chunked attention reorders float sums (the same softmax)
    for f in ("prox_logprobs", "ref_logprobs", "old_values", "advantages"):
        np.testing.assert_allclose(np.asarray(getattr(prep1, f)), np.asarray(getattr(prep0, f)), rtol=0, atol=1e-5,
                                   err_msg=f)
    assert float(jnp.abs(prep0.prox_logprobs).max()) > 1.0  # the prepare pass really scored tokens
    for k in ("loss", "pg_loss", "entropy", "kl_ref", "vf_loss"):
        np.testing.assert_allclose(float(m1[k]), float(m0[k]), rtol=1e-6, atol=atol / 10, err_msg=k)
    leaves0, leaves1 = jax.tree.leaves(g0), jax.tree.leaves(g1)
    assert len(leaves0) == len(leaves1) > 10
    for a, b in zip(leaves0, leaves1):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=0, atol=atol)
    assert max(float(jnp.abs(a).max()) for a in leaves0) > 1e-2


def test_config_fields_validated():
    from laminar_jax.configlib import ConfigError

    assert typing.get_args(typing.get_type_hints(LearnerSection)["remat"]) == REMAT_POLICIES
    assert typing.get_args(typing.get_type_hints(LearnerSection)["attention_impl"]) == ("auto", *TRAIN_ATTENTION)
    with pytest.raises(ConfigError, match=r"learner\.logits_chunk_tokens"):
        LearnerSection(logits_chunk_tokens=-1).validate("learner")
    with pytest.raises(ConfigError, match=r"learner\.remat"):
        LearnerSection(remat="everything").validate("learner")
    with pytest.raises(ConfigError, match=r"learner\.attention_impl"):
        LearnerSection(attention_impl="ring").validate("learner")
    with pytest.raises(ConfigError, match=r"learner\.attention_chunk"):
        LearnerSection(attention_chunk=0).validate("learner")
