"""learner.lora: float32 adapters train on a frozen base held in the serving dtype; the optimizer holds
the adapters' state only; each published version is the adapters (the policy: the base with them merged);
resume is exact."""

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from laminar_jax.learner import Learner, LearnerSection
from laminar_jax.learner.publish import LocalPublisher, flatten_params, load_model_params
from laminar_jax.model import Transformer, lora, token_logprobs
from laminar_jax.model.lora_version import BASE_ID, SCALE
from laminar_jax.model.arch import TransformerConfig
from laminar_jax.types import Trajectory
from tests.learner.fixed_batch import two_groups

CFG = TransformerConfig(model_type="llama", vocab_size=16, hidden_size=32, intermediate_size=64, num_layers=2,
                        num_heads=2, num_kv_heads=1, head_dim=16, max_position_embeddings=64,
                        tie_word_embeddings=True, bos_token_id=1, eos_token_id=(2,))
LORA = lora.LoRASection(rank=4, alpha=8.0)
SECTION = LearnerSection(lr=1e-2, adv_estimator="grpo", off_policy="tis", seq_len_buckets=(16,), pack_length=0,
                         lora=LORA)


def _trajectories(version: int = 0) -> list[Trajectory]:
    """Two groups of four; the responses holding more 7s score higher (a fixed batch with a signal)."""
    return two_groups(version, bonus_per_sample=1 / 8)


def _model() -> Transformer:
    return Transformer(CFG, rngs=nnx.Rngs(0), dtype=jnp.bfloat16, param_dtype=jnp.float32)


def _learner(**kw) -> tuple[Learner, LocalPublisher]:
    pub = LocalPublisher()
    return Learner(dataclasses.replace(SECTION, **kw), _model(), publish_dtype="bfloat16", publisher=pub), pub


def _weighted_logp(flat: dict[str, np.ndarray], trajs: list[Trajectory]) -> float:
    """sum_i A_i * log p(response_i) under a plain model holding ``flat`` (A: group-centred rewards);
    the policy-gradient objective the steps ascend."""
    model = Transformer(CFG, rngs=nnx.Rngs(1))
    load_model_params(model, {k: np.asarray(v, np.float32) for k, v in flat.items()})
    total = 0.0
    for g in range(2):
        group = trajs[4 * g:4 * g + 4]
        mean = np.mean([t.reward for t in group])
        for t in group:
            seq = np.concatenate([t.prompt_ids, t.response_ids])[None]
            lp = token_logprobs(model(jnp.asarray(seq[:, :-1])), jnp.asarray(seq[:, 1:]))[0, len(t.prompt_ids) - 1:]
            total += (t.reward - mean) * float(lp.sum())
    return total


def test_adapters_train_base_stays_frozen_and_versions_are_merged():
    learner, pub = _learner()
    base0 = jax.tree.map(np.asarray, learner.state.frozen["actor"])
    assert {x.dtype for x in jax.tree.leaves(base0)} == {np.dtype(ml_dtypes.bfloat16)}  # the serving dtype
    adapters0 = learner.adapter_params()
    shapes = lora.param_shapes_of(CFG)
    assert {k: v.shape for k, v in adapters0.items()} == lora.adapter_shapes(shapes, LORA.targets, LORA.rank)
    assert all(v.dtype == np.float32 for v in adapters0.values())
    # The optimizer's state covers the adapters only: two AdamW moments of each, and scalars.
    opt_values = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(learner.state.opt_state))
    assert opt_values - 2 * sum(v.size for v in adapters0.values()) < 8
    trajs = _trajectories()
    before = _weighted_logp(learner.policy_params(), trajs)
    for _ in range(4):
        m = learner.step(trajs)
        assert m["skipped"] == 0
    jax.tree.map(np.testing.assert_array_equal, base0, jax.tree.map(np.asarray, learner.state.frozen["actor"]))
    adapters = learner.adapter_params()
    assert all(np.abs(adapters[n] - adapters0[n]).max() > 0 for n in adapters0 if n.endswith(".lora_b"))
    after = _weighted_logp(learner.policy_params(), trajs)
    assert after > before + 0.5, (before, after)  # the policy-gradient loss (-objective) decreases
    # What is published is the adapter version (the adapters, the base's identity and the scale:
    # model/lora_version.py); the policy (policy_params) is the base with the adapters merged, under
    # the base's names, in the serving dtype.
    learner.flush(60)
    version, flat = pub.latest()
    assert version == 4 and set(flat) == set(adapters) | {BASE_ID, SCALE}
    for name in adapters:
        np.testing.assert_array_equal(flat[name], adapters[name])
    merged = learner.policy_params()
    assert set(merged) == set(shapes)
    base_flat = {k: np.asarray(v) for k, v in flatten_params(base0).items()}
    want = lora.merge_params(base_flat, adapters, LORA.scale)
    for name in merged:
        assert merged[name].dtype == ml_dtypes.bfloat16, name
        np.testing.assert_allclose(np.asarray(merged[name], np.float32), np.asarray(want[name], np.float32),
                                   rtol=1e-2, atol=1e-2)
    assert not np.array_equal(np.asarray(merged["layers.self_attn.q_proj.weight"]),
                              base_flat["layers.self_attn.q_proj.weight"])


def test_kl_reference_is_the_base():
    """With a KL term and no reference model the base is the reference: the first step's KL is 0."""
    learner, _ = _learner(kl_coef=0.1, kl_mode="loss")
    assert learner.ref_params is None
    m = learner.step(_trajectories())
    assert abs(m["kl_ref"]) < 1e-6 and m["skipped"] == 0
    m = learner.step(_trajectories(1))
    assert m["kl_ref"] > 0


def test_resume_restores_adapters_and_their_optimizer_state_exactly(tmp_path):
    trajs = _trajectories()
    a, _ = _learner(checkpoint_dir=str(tmp_path), async_checkpoint=False)
    a.step(trajs)
    a.step(trajs)
    a.save(2, {"ledger": "x"})
    a.flush()
    a.step(trajs)
    want = a.adapter_params()
    b, _ = _learner(checkpoint_dir=str(tmp_path), async_checkpoint=False)
    assert b.restore_latest() == {"ledger": "x"} and b.version == 2
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, a.state.frozen),
                 jax.tree.map(np.asarray, b.state.frozen))
    b.step(trajs)
    got = b.adapter_params()
    for n in want:
        np.testing.assert_array_equal(got[n], want[n], err_msg=n)
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, a.state.opt_state),
                 jax.tree.map(np.asarray, b.state.opt_state))
    a.close()
    b.close()


def test_warmup_compiles_the_lora_programs():
    """Warm-up lowers the prepare pass with the frozen base as the step calls it (learner.compile_ahead='all')."""
    learner, _ = _learner()
    assert learner.warmup(8) == 1
    assert learner.step(_trajectories())["skipped"] == 0
