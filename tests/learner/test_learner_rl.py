"""End-to-end learning on a toy bandit: GRPO and PPO-with-critic both raise the reward.

Task: prompt [BOS, p] (p in 3..9), the policy samples R=6 tokens; reward = fraction of response
tokens equal to TARGET. A 1-layer, 16-token model starts near 1/16. Responses are sampled here
with a small jitted sampler (the rollout plane is separate); each step is on-policy (version
stamped, behaviour log-probs recorded).
"""


import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from laminar_jax.learner import Learner, LearnerSection
from laminar_jax.model import Transformer, token_logprobs
from laminar_jax.model.arch import TransformerConfig
from laminar_jax.types import Trajectory

TARGET = 7
R = 6
CFG = TransformerConfig(model_type="llama", vocab_size=16, hidden_size=32, intermediate_size=64, num_layers=1,
                        num_heads=2, num_kv_heads=1, head_dim=16, max_position_embeddings=64,
                        tie_word_embeddings=True, bos_token_id=1, eos_token_id=(2,))


def make_sampler(graphdef, prompt_len: int, resp_len: int):
    @jax.jit
    def sample(params, prompts, key):  # prompts i32[N, P] -> (tokens i32[N, R], logprobs f32[N, R])
        n = prompts.shape[0]
        buf = jnp.concatenate([prompts, jnp.zeros((n, resp_len), jnp.int32)], axis=1)
        model = nnx.merge(graphdef, params)

        def body(i, carry):
            buf, lps = carry
            logits = jax.lax.dynamic_index_in_dim(model(buf), prompt_len + i - 1, axis=1, keepdims=False)
            tok = jax.random.categorical(jax.random.fold_in(key, i), logits).astype(jnp.int32)
            lps = lps.at[:, i].set(token_logprobs(logits, tok))
            return buf.at[:, prompt_len + i].set(tok), lps

        buf, lps = jax.lax.fori_loop(0, resp_len, body, (buf, jnp.zeros((n, resp_len), jnp.float32)))
        return buf[:, prompt_len:], lps

    return sample


def run_toy(section: LearnerSection, steps: int, prompts_per_step: int, group: int, seed: int = 0):
    model = Transformer(CFG, rngs=nnx.Rngs(seed), value_head=section.critic == "shared")
    learner = Learner(section, model)
    sample = make_sampler(learner.graphs.actor, 2, R)
    rng = np.random.default_rng(seed)
    key = jax.random.key(seed)
    rewards = []
    for step in range(steps):
        ps = np.repeat(rng.integers(3, 10, prompts_per_step), group)
        prompts = np.stack([np.ones_like(ps), ps], axis=1).astype(np.int32)
        toks, lps = sample(learner.state.params["actor"], jnp.asarray(prompts), jax.random.fold_in(key, step))
        toks, lps = np.asarray(toks), np.asarray(lps)
        trajs = []
        for i in range(len(ps)):
            reward = float(np.mean(toks[i] == TARGET))
            trajs.append(Trajectory(f"{step}-{i // group}/{i % group}", f"{step}-{i // group}", i % group,
                                    prompts[i], toks[i], lps[i], learner.version, reward=reward))
        m = learner.step(trajs)
        rewards.append(m["reward_mean"])
        assert m["skipped"] == 0 and m["staleness_max"] == 0
    return rewards


def _assert_improves(rewards):
    first, last = np.mean(rewards[:3]), np.mean(rewards[-3:])
    assert last > first + 0.25 and last > 0.4, f"reward did not increase: {np.round(rewards, 3)}"


def test_grpo_increases_reward():
    section = LearnerSection(lr=5e-3, adv_estimator="grpo", critic="none", loss_agg="seq-mean-token-mean",
                             clip_eps_high=0.28, seq_len_buckets=(8, 16))
    _assert_improves(run_toy(section, steps=25, prompts_per_step=8, group=8))


def test_ppo_with_critic_increases_reward():
    section = LearnerSection(lr=3e-3, adv_estimator="gae", critic="shared", gamma=1.0, lam=0.95, vf_coef=0.5,
                             mini_batches=2, seq_len_buckets=(8, 16))
    _assert_improves(run_toy(section, steps=20, prompts_per_step=32, group=1))
