"""A LoRA version on a rollout server: only adapters arrive; the server merges them into its pristine
base at the swap, and serves what the learner's merged model computes.

Real engine and server (tiny model): the served weights after a swap are compared with the merge of
the same base and adapters (rollout/lora_merge.merge, the learner's), and the logits of the served
weights with the merged model's. A second version merges into the base again, not into the first
merge; a version of another base is refused naming both identities.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from laminar_jax.learner.publish import flatten_params
from laminar_jax.model.lora_version import BaseMismatchError, adapter_version, base_identity
from laminar_jax.rollout import RolloutServer, make_engine
from laminar_jax.rollout.lora_merge import merge
from laminar_jax.runtime.fleet import params_from_flat
from laminar_jax.weights.lora_base import ServedBase
from tests.rollout.rollout_helpers import SECTION, params_of, tiny_model

TARGETS = ("layers.self_attn.q_proj.weight", "layers.self_attn.v_proj.weight", "layers.mlp.down_proj.weight")
RANK = 4


def _base_flat(seed: int = 0) -> dict:
    return {k: np.array(v) for k, v in flatten_params(params_of(seed)).items()}


def _adapters(base: dict, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    out = {}
    for name in TARGETS:
        layers, d_out, d_in = base[name].shape
        stem = name[:-len(".weight")]  # model/lora.py adapter_names
        out[stem + ".lora_a"] = rng.normal(0, 0.3, (layers, RANK, d_in)).astype(np.float32)
        out[stem + ".lora_b"] = rng.normal(0, 0.3, (layers, d_out, RANK)).astype(np.float32)
    return out


def _learner_merged(base: dict, adapters: dict, scale: float) -> dict:
    """The learner's merged model: every targeted parameter merged, the others the base."""
    stems = {n: n[:-len(".weight")] for n in base}
    return {n: np.asarray(merge(w, adapters[stems[n] + ".lora_a"], adapters[stems[n] + ".lora_b"], scale))
            if stems[n] + ".lora_a" in adapters else w for n, w in base.items()}


def _logits(flat: dict, tokens: np.ndarray) -> np.ndarray:
    model = tiny_model(0)
    graphdef, state = nnx.split(model)
    from laminar_jax.weights.host import host_params

    return np.asarray(nnx.merge(graphdef, host_params(flat, state))(tokens))


def _served_flat(server: RolloutServer) -> dict:
    return {k: np.asarray(v) for k, v in flatten_params(server._params).items()}


@pytest.mark.parametrize("stream", [True, False])
def test_served_weights_and_logits_equal_the_learners_merged_model(stream):
    base = _base_flat(0)
    served = ServedBase(base, nnx.split(tiny_model(0))[1])
    engine, _ = make_engine(tiny_model(0), SECTION)
    from_flat = params_from_flat(tiny_model(0), engine, stream=stream, base=served)
    server = RolloutServer(engine, from_flat(adapter_version(_adapters(base, 1), served.id, 0.5)), version=1)
    untargeted = {n: x for n, x in flatten_params(server._params).items() if n not in TARGETS}
    tokens = np.array([[1, 5, 9, 17, 33, 2, 40, 41]], np.int32)
    for version, seed, scale in ((2, 2, 2.0), (3, 3, 0.25)):
        adapters = _adapters(base, seed)
        server.set_params(version, from_flat(adapter_version(adapters, served.id, scale)), force=True)
        server.step()  # the swap happens at the start of the step
        assert server.version == version
        want = _learner_merged(base, adapters, scale)
        got = _served_flat(server)
        for name in want:  # each version merges into the pristine base: merges never accumulate
            np.testing.assert_array_equal(got[name], want[name], err_msg=name)
        np.testing.assert_allclose(_logits(got, tokens), _logits(want, tokens), rtol=1e-6, atol=1e-6)
        assert not np.allclose(_logits(got, tokens), _logits(base, tokens), atol=1e-3)  # the adapters count
    if stream:  # parameters no adapter targets stay where they were: no bytes moved for them
        now = flatten_params(server._params)
        assert all(now[n] is x for n, x in untargeted.items())


def test_an_adapter_version_of_another_base_is_refused_naming_both():
    base = _base_flat(0)
    served = ServedBase(base, nnx.split(tiny_model(0))[1])
    other = base_identity(_base_flat(1))
    from_flat = params_from_flat(tiny_model(0), None, stream=True, base=served)
    with pytest.raises(BaseMismatchError) as e:
        from_flat(adapter_version(_adapters(base, 1), other, 1.0))
    assert other in str(e.value) and served.id in str(e.value)


def test_bad_adapter_versions_are_refused_naming_the_tensor():
    base = _base_flat(0)
    served = ServedBase(base, nnx.split(tiny_model(0))[1])
    from_flat = params_from_flat(tiny_model(0), None, stream=True, base=served)
    adapters = _adapters(base, 1)
    with pytest.raises(ValueError, match="full weight version"):
        from_flat(base)
    lonely = {k: v for k, v in adapters.items() if not k.endswith("q_proj.lora_b")}
    with pytest.raises(ValueError, match="q_proj.lora_a"):
        from_flat(adapter_version(lonely, served.id, 1.0))
    with pytest.raises(ValueError, match="no base"):  # a server without a base cannot take adapters
        params_from_flat(tiny_model(0), None, stream=True)(adapter_version(adapters, served.id, 1.0))


def test_base_identity_names_the_bytes():
    base = _base_flat(0)
    same = {k: v.copy() for k, v in base.items()}
    assert base_identity(base) == base_identity(same)
    name = "layers.mlp.up_proj.weight"
    same[name] = same[name].copy()
    same[name][0, 0, 0] += 1e-3
    assert base_identity(same) != base_identity(base)
    assert base_identity({k: jax.numpy.asarray(v, jax.numpy.bfloat16) for k, v in base.items()}) != base_identity(base)
