"""learner.lora.dropout: dropout on the adapters' input in the training forward only (PEFT's
lora_dropout), its masks drawn from the TrainState's key: reproducible from a state, different for
another key, absent from the log-prob passes; at 0.0 no key enters the step."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from laminar_jax.configlib import ConfigError
from laminar_jax.learner import Learner, LearnerSection
from laminar_jax.learner.publish import LocalPublisher
from laminar_jax.learner.step import forward
from laminar_jax.model import Transformer, lora
from laminar_jax.model.arch import TransformerConfig
from tests.learner.fixed_batch import two_groups

CFG = TransformerConfig(model_type="llama", vocab_size=16, hidden_size=32, intermediate_size=64, num_layers=2,
                        num_heads=2, num_kv_heads=1, head_dim=16, max_position_embeddings=64,
                        tie_word_embeddings=True, bos_token_id=1, eos_token_id=(2,))
SECTION = LearnerSection(lr=1e-2, adv_estimator="grpo", off_policy="tis", seq_len_buckets=(16,), pack_length=0,
                         lora=lora.LoRASection(rank=4, alpha=8.0, dropout=0.3))


def _learner(dropout: float = 0.3, **kw) -> Learner:
    section = dataclasses.replace(SECTION, lora=dataclasses.replace(SECTION.lora, dropout=dropout), **kw)
    model = Transformer(CFG, rngs=nnx.Rngs(0), dtype=jnp.float32, param_dtype=jnp.float32)
    return Learner(section, model, publish_dtype="float32", publisher=LocalPublisher())


def _runs(learner: Learner, *rngs) -> list[dict[str, np.ndarray]]:
    """The adapters after one step from the learner's initial state, once per state key in ``rngs``
    (None: the state's own key); one learner, so its programs compile once."""
    state0, out = jax.tree.map(np.asarray, learner.state), []
    for rng in rngs:
        state = state0 if rng is None else state0._replace(rng=jax.random.key_data(jax.random.key(rng)))
        learner.state, learner.version = jax.tree.map(jnp.asarray, state), 0
        assert learner.step(two_groups(0, 1 / 8), publish=False)["skipped"] == 0
        out.append(learner.adapter_params())
    learner.close()
    return out


def _same(a: dict, b: dict) -> bool:
    return all(np.array_equal(a[n], b[n]) for n in a)


@pytest.mark.parametrize("bad", [-0.1, 1.0, 1.5])
def test_dropout_outside_0_1_is_refused_naming_the_key(bad):
    with pytest.raises(ConfigError, match=r"learner\.lora\.dropout"):
        lora.LoRASection(rank=4, dropout=bad).validate("learner.lora")


def test_the_training_forward_drops_adapter_inputs_by_its_key():
    learner = _learner(dropout=0.5)
    assert learner.step(two_groups(0, 1 / 8))["skipped"] == 0  # B is nonzero now: the adapters' path shows
    params = nnx.merge_state(learner.state.frozen["actor"], learner.state.params["actor"])
    batch = learner.collate(two_groups())
    rate0 = dataclasses.replace(learner.section, lora=dataclasses.replace(learner.section.lora, dropout=0.0))

    @jax.jit
    def fwd(key):
        def logp(section, k):
            return forward(learner.graphs.actor, params, batch, section, dropout_key=k).logp

        return logp(learner.section, None), logp(learner.section, key), logp(rate0, key)

    plain, d0, rate0_d0 = map(np.asarray, fwd(jax.random.key(0)))
    assert np.array_equal(d0, np.asarray(fwd(jax.random.key(0))[1]))
    assert not np.allclose(d0, plain) and not np.allclose(d0, np.asarray(fwd(jax.random.key(1))[1]))
    np.testing.assert_array_equal(rate0_d0, plain)


def test_a_step_is_reproducible_from_its_state_and_another_key_draws_other_masks():
    a, b, c = _runs(_learner(), None, None, 123)
    assert _same(a, b)
    assert not _same(a, c)
    # Without dropout the key draws nothing: another key gives the same bits.
    assert _same(*_runs(_learner(0.0), None, 123))


def test_micro_and_mini_batches_draw_their_own_masks():
    """Updates over mini-batches (a scan of updates) of micro-batches (a scan of gradients), each drawing
    from its own key: reproducible from the state, and another state key changes them."""
    a, b, c = _runs(_learner(micro_batches=2, mini_batches=2), None, None, 123)
    assert _same(a, b) and not _same(a, c)


def test_the_log_prob_pass_has_no_dropout():
    """The prepare pass (proximal and reference log-probs) of a dropout learner equals a dropout-free
    one's on the same state; only the gradient pass differs."""
    drop, plain = _learner(dropout=0.5, kl_coef=0.1, kl_mode="loss"), _learner(dropout=0.0, kl_coef=0.1,
                                                                               kl_mode="loss")
    assert drop.step(two_groups(0, 1 / 8))["skipped"] == 0  # trains B away from zero
    plain.state = drop.state
    batch = drop.prepare(two_groups(1), drop.version).batch
    got = [drop._prepare(ln.state.params, ln.ref_params, batch, *ln._frozen(ln.state.frozen))
           for ln in (drop, plain)]
    for name in ("old_logprobs", "prox_logprobs", "ref_logprobs", "advantages"):
        np.testing.assert_array_equal(np.asarray(getattr(got[0], name)), np.asarray(getattr(got[1], name)), name)


def test_resume_draws_the_same_masks(tmp_path):
    """The dropout key is in the checkpointed TrainState: a resumed learner's next update equals the
    uninterrupted one's bit for bit."""
    trajs = two_groups(0, 1 / 8)
    a = _learner(checkpoint_dir=str(tmp_path), async_checkpoint=False)
    a.step(trajs)
    a.save(1, {})
    a.flush()
    a.step(trajs)
    want = a.adapter_params()
    b = _learner(checkpoint_dir=str(tmp_path), async_checkpoint=False)
    b.restore_latest()
    b.step(trajs)
    assert _same(want, b.adapter_params())
    a.close()
    b.close()
