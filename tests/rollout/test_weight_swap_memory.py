"""A weight swap streams the new version into place: the device never holds two versions.

The swap runs for real (RolloutServer.set_params + step on a real engine); the device's live
bytes are sampled after every tensor placement (HostWeights.on_leaf) and compared with one version
+ the KV pool + the largest tensor. Placing the whole new version while the old one is still held
(the swap before streaming) would exceed that bound by about a version.
"""

from __future__ import annotations

import gc

import jax
import numpy as np
import pytest

from laminar_jax.rollout import HostWeights, RolloutServer, make_engine
from tests.rollout.rollout_helpers import SECTION, params_of, request, run_until, tiny_model


def _host(seed: int):
    return jax.tree.map(lambda x: np.array(x), params_of(seed))


def _live_bytes(device) -> int:
    """Bytes of every live array's shard on ``device`` (from the shardings: reading shard.data would
    itself make arrays that later samples count)."""
    return sum(int(np.prod(a.sharding.shard_shape(a.shape))) * a.dtype.itemsize for a in jax.live_arrays()
               if not a.is_deleted() and device in a.sharding.device_set)


def _server(seed: int) -> RolloutServer:
    engine, _ = make_engine(tiny_model(seed), SECTION)
    return RolloutServer(engine, HostWeights(_host(seed)), version=0)


@pytest.mark.parametrize("force", [False, True])
def test_streamed_swap_peak_is_one_version_plus_one_tensor(force):
    server = _server(0)
    device = server.engine.devices[0]
    for i in range(3):
        server.submit(request(i))
    run_until(server, 3)
    if force:  # a forced swap aborts live sequences first: the same streaming path
        server.submit(request(7, max_new=20))
        server.step()
        server.step()
    old = jax.tree.leaves(server._params)
    sizes = [x.nbytes for x in old]
    version, largest = sum(sizes), max(sizes)
    assert version > 4 * largest  # the bound below would not hide a second version
    new = _host(1)
    gc.collect()
    baseline = _live_bytes(device)
    assert baseline >= version + sum(x.nbytes for x in server._state.k_pages)  # one version + (part of) KV
    samples: list[int] = []
    server.set_params(1, HostWeights(new, on_leaf=lambda i, x: samples.append(_live_bytes(device))),
                      force=force)
    server.step()  # the swap happens at the start of the step
    assert server.version == 1 and len(samples) == len(old)
    slack = 4096
    assert max(samples) <= baseline + largest + slack, (max(samples) - baseline, largest)
    assert all(x.is_deleted() for x in old)  # every old buffer was freed, not left to the GC
    assert _live_bytes(device) <= baseline + slack


def test_generation_after_a_streamed_swap_uses_the_new_weights():
    swapped = _server(0)
    swapped.submit(request(0))
    run_until(swapped, 1)
    swapped.set_params(1, HostWeights(_host(1)))
    swapped.submit(request(1))
    got = run_until(swapped, 1)["p1/0"]
    fresh = _server(1)
    fresh.submit(request(1))
    want = run_until(fresh, 1)["p1/0"]
    assert got.version == 1
    assert list(got.response_ids) == list(want.response_ids)
    np.testing.assert_allclose(got.behaviour_logprobs, want.behaviour_logprobs, rtol=1e-6, atol=1e-6)
    before = _server(0)
    before.submit(request(1))
    old = run_until(before, 1)["p1/0"]
    assert list(old.response_ids) != list(want.response_ids) or not np.allclose(old.behaviour_logprobs, want.behaviour_logprobs)


def test_a_server_built_from_abstract_shapes_serves_the_pulled_version():
    """No template model: the engine comes from nnx.eval_shape shapes, the weights from a published
    (flat, value head dropped) version, streamed in; it generates what a concrete-model server does."""
    from flax import nnx

    from laminar_jax.learner.publish import flatten_params
    from laminar_jax.model.config import ModelSection
    from laminar_jax.model.sharded import abstract_model, load_model
    from laminar_jax.runtime.fleet import params_from_flat

    section = ModelSection(preset="tiny", value_head=True, seed=1)
    abstract = abstract_model(section)
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(nnx.state(abstract)))
    engine, params = make_engine(abstract, SECTION)
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(params))  # nothing placed
    concrete = load_model(section)
    flat = {k: np.asarray(v) for k, v in flatten_params(nnx.state(concrete)).items()}  # as published
    assert not any(k.startswith("value_head") for k in flat)
    from_flat = params_from_flat(abstract, engine)
    server = RolloutServer(engine, from_flat(flat), version=3)
    server.submit(request(2))
    got = run_until(server, 1)["p2/0"]
    want_engine, want_params = make_engine(concrete, SECTION)
    want_server = RolloutServer(want_engine, want_params, version=3)
    want_server.submit(request(2))
    want = run_until(want_server, 1)["p2/0"]
    assert list(got.response_ids) == list(want.response_ids)
    np.testing.assert_allclose(got.behaviour_logprobs, want.behaviour_logprobs, rtol=1e-6, atol=1e-6)
