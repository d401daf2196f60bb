"""A LoRA learner publishes adapters only, and a server given that version serves the learner's model.

Real Learner (learner.lora on the tiny model) and a real rollout engine: the version the learner
publishes (through its HostCopy path, after real steps) holds only the adapters, the base's identity and the scale; a server that
holds the learner's base (ServedBase) swaps to it, and its logits equal the learner's own model's
(policy_params: the base with the adapters merged) to float rounding.
"""

from __future__ import annotations


import numpy as np
from flax import nnx

from laminar_jax.learner import Learner, LearnerSection
from laminar_jax.learner.publish import LocalPublisher, flatten_params
from laminar_jax.model import PRESETS, Transformer
from laminar_jax.model.lora import LoRASection, merge_params
from laminar_jax.model.lora_version import BASE_ID, SCALE, base_identity
from laminar_jax.rollout import RolloutServer, make_engine
from laminar_jax.runtime.fleet import params_from_flat
from laminar_jax.weights.lora_base import ServedBase
from laminar_jax.types import Trajectory
from tests.rollout.rollout_helpers import SECTION as ROLLOUT

LORA = LoRASection(rank=4, alpha=8.0, targets=("q_proj", "v_proj", "up_proj", "down_proj"))
SECTION = LearnerSection(lr=1e-2, adv_estimator="grpo", off_policy="tis", seq_len_buckets=(16,), pack_length=0,
                         lora=LORA)


def _trajectories() -> list[Trajectory]:
    rng = np.random.default_rng(0)
    return [Trajectory(f"{g}/{i}", f"p{g}", i, np.array([1, 3 + g], np.int32), rng.integers(3, 100, 6).astype(np.int32),
                       np.full(6, -2.0, np.float32), 0, reward=float(i % 2)) for g in range(2) for i in range(4)]


def test_a_lora_learner_publishes_adapters_and_the_server_serves_its_model():
    pub = LocalPublisher()
    learner = Learner(SECTION, Transformer(PRESETS["tiny"], rngs=nnx.Rngs(0)), publisher=pub)
    for _ in range(3):  # B starts at zero: a few steps make the adapters count
        learner.step(_trajectories())
    learner.flush(60)
    version, flat = pub.latest()
    adapters = {n for n in flat if n not in (BASE_ID, SCALE)}
    assert version == 3 and adapters and all(n.endswith((".lora_a", ".lora_b")) for n in adapters)
    assert len(adapters) == 2 * len(LORA.targets)
    base = learner.lora.base()
    assert not any(n.endswith((".lora_a", ".lora_b")) for n in base)
    assert bytes(np.asarray(flat[BASE_ID])).hex() == base_identity(base)
    full = sum(x.nbytes for x in base.values())
    assert sum(flat[n].nbytes for n in adapters) < full / 2

    plain = Transformer(PRESETS["tiny"], rngs=nnx.Rngs(0))
    served = ServedBase(base, nnx.split(plain)[1])
    engine, _ = make_engine(plain, ROLLOUT)
    from_flat = params_from_flat(plain, engine, stream=True, base=served)
    server = RolloutServer(engine, from_flat(learner.published_params()), version=0)
    server.set_params(version, from_flat(flat), force=True)
    server.step()
    assert server.version == version
    got = {k: np.asarray(v) for k, v in flatten_params(server._params).items()}
    want = merge_params(base, {n: np.asarray(flat[n]) for n in adapters}, LORA.scale)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-6, atol=1e-6, err_msg=name)
    tokens = np.array([[1, 5, 9, 17, 33, 2, 40, 41]], np.int32)
    graphdef, state = nnx.split(plain)
    from laminar_jax.weights.host import host_params

    served_logits = np.asarray(nnx.merge(graphdef, host_params(got, state))(tokens))
    learner_logits = np.asarray(nnx.merge(graphdef, host_params(learner.policy_params(), state))(tokens))
    np.testing.assert_allclose(served_logits, learner_logits, rtol=1e-5, atol=1e-5)  # the learner's merged model
    base_logits = np.asarray(nnx.merge(graphdef, host_params(base, state))(tokens))
    assert not np.allclose(served_logits, base_logits, atol=1e-3)  # the adapters count
    learner.close()
