"""Sampling math, the key schedule, the page allocator and config validation (no model needed)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from laminar_jax.configlib import ConfigError
from laminar_jax.model import token_logprobs
from laminar_jax.rollout import OutOfPages, PageAllocator, RolloutSection, SamplingParams, sample_tokens

V = 12


def _logits(b=4, seed=0):
    return jax.random.normal(jax.random.key(seed), (b, V)) * 2.0


def _keys(b, t=0):
    return jax.vmap(jax.random.fold_in)(jax.random.split(jax.random.key(7), b), jnp.full((b,), t))


def _draw(logits, temp, top_k, top_p, n=400):
    """Tokens drawn with n different keys per row: i32[n, B]."""
    b = logits.shape[0]
    f = jax.jit(jax.vmap(lambda t: sample_tokens(logits, _keys(b, t), jnp.full((b,), temp), jnp.full((b,), top_k),
                                                  jnp.full((b,), top_p))[0]))
    return np.asarray(f(jnp.arange(n)))


def test_untruncated_logprob_is_the_learner_definition_exactly():
    logits = _logits()
    tok, lp = sample_tokens(logits, _keys(4), jnp.full((4,), 0.8), jnp.zeros(4, jnp.int32), jnp.ones(4))
    np.testing.assert_array_equal(np.asarray(lp), np.asarray(token_logprobs(logits, tok, 0.8)))


def test_greedy_is_argmax_with_untempered_logprob():
    logits = _logits()
    tok, lp = sample_tokens(logits, _keys(4), jnp.zeros(4), jnp.full((4,), 3, jnp.int32), jnp.full((4,), 0.5))
    np.testing.assert_array_equal(np.asarray(tok), np.argmax(np.asarray(logits), -1))
    np.testing.assert_allclose(np.asarray(lp), np.asarray(token_logprobs(logits, tok, 1.0)), rtol=1e-6)


def test_top_k_support_and_renormalised_logprob():
    logits = _logits()
    draws = _draw(logits, 1.0, 3, 1.0)
    top3 = np.argsort(-np.asarray(logits), -1)[:, :3]
    for row in range(4):
        assert set(draws[:, row]) <= set(top3[row])
        assert len(set(draws[:, row])) > 1  # still random within the support
    tok, lp = sample_tokens(logits, _keys(4), jnp.ones(4), jnp.full((4,), 3, jnp.int32), jnp.ones(4))
    kept = np.take_along_axis(np.asarray(logits), top3, -1)
    ref = np.asarray(logits)[np.arange(4), np.asarray(tok)] - np.log(np.exp(kept).sum(-1))
    np.testing.assert_allclose(np.asarray(lp), ref, rtol=1e-5)


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05] + [1e-9] * (V - 4)]))
    draws = _draw(logits, 1.0, 0, 0.75)
    assert set(draws[:, 0]) == {0, 1}  # 0.5 < 0.75 <= 0.8
    assert abs((draws[:, 0] == 0).mean() - 0.5 / 0.8) < 0.08  # renormalised over the kept mass


def test_mixed_rows_do_not_truncate_each_other():
    logits = jnp.concatenate([_logits(1), _logits(1)])
    b = 2
    f = jax.jit(jax.vmap(lambda t: sample_tokens(logits, _keys(b, t), jnp.ones(b), jnp.array([2, 0], jnp.int32),
                                                  jnp.ones(b))[0]))
    draws = np.asarray(f(jnp.arange(400)))
    assert len(set(draws[:, 0])) <= 2 < len(set(draws[:, 1]))


def test_key_schedule_depends_only_on_key_and_index():
    """Same (key_s, t) -> same token regardless of the batch row or the other rows."""
    logits = _logits(1)
    key = jax.random.fold_in(jax.random.key(3), 5)
    row = lambda lg, k: sample_tokens(lg, k, jnp.ones(lg.shape[0]), jnp.zeros(lg.shape[0], jnp.int32),  # noqa
                                      jnp.ones(lg.shape[0]))[0]
    alone = row(logits, key[None])
    batch = jnp.concatenate([_logits(2, seed=9), logits])
    keys = jnp.stack([jax.random.key(1), jax.random.key(2), key])
    assert int(row(batch, keys)[2]) == int(alone[0])


def test_page_allocator_never_hands_out_the_null_page():
    a = PageAllocator(5)
    pages = a.allocate(4)
    assert sorted(pages) == [1, 2, 3, 4] and a.num_free == 0
    with pytest.raises(OutOfPages, match="need 1 KV pages, 0 free"):
        a.allocate(1)
    a.free(pages[:2])
    assert a.num_free == 2 and a.num_used == 2
    with pytest.raises(ValueError, match="double free"):
        a.free(pages[:1])


@pytest.mark.parametrize("field,value,msg", [
    ("top_p", 1.5, r"rollout.top_p=1.5: must be in \(0, 1\]"),
    ("top_p", 0.0, r"rollout.top_p=0.0"),
    ("top_k", -1, r"rollout.top_k=-1"),
    ("temperature", -0.5, r"rollout.temperature=-0.5"),
    ("max_new_tokens", 0, r"rollout.max_new_tokens=0"),
    ("attention_impl", "flash", r"rollout.attention_impl='flash'"),
    ("num_pages", 3, r"rollout.num_pages=3"),
])
def test_invalid_config_names_the_field(field, value, msg):
    with pytest.raises(ConfigError, match=msg):
        RolloutSection(**{field: value}).validate("rollout")


def test_invalid_request_sampling_names_the_field():
    with pytest.raises(ConfigError, match=r"request\[a/0\].sampling.top_p=2.0"):
        SamplingParams(top_p=2.0).validate("request[a/0].sampling")


def test_default_buckets_are_powers_of_two_up_to_max_prompt_len():
    assert RolloutSection(max_prompt_len=100, max_total_len=200).buckets() == (16, 32, 64, 128)
