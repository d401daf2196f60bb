"""Mixed precision: float32 master weights under a bfloat16 model, and versions served in rollout.dtype.

The tiny model's RMSNorm weights start at exactly 1.0, where bfloat16's steps are 2^-8 below and
2^-7 above: an AdamW update of lr = 1e-4 (|update| <= ~lr for a steady gradient) is far under half
a step, so a bfloat16 parameter rounds it away every time. 64 updates through the real train step
move the float32 master by ~6e-3, past a bfloat16 step, so the served (published, bfloat16)
weights change; the same run without a master copy (learner.master_weights=False, the old path)
serves exactly the starting weights.
"""

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from laminar_jax.learner import Learner, LearnerSection
from laminar_jax.learner.publish import LocalPublisher
from laminar_jax.model import Transformer
from laminar_jax.model.arch import TransformerConfig
from laminar_jax.types import Trajectory
from tests.learner.fixed_batch import two_groups

CFG = TransformerConfig(model_type="llama", vocab_size=16, hidden_size=32, intermediate_size=64, num_layers=1,
                        num_heads=2, num_kv_heads=1, head_dim=16, max_position_embeddings=64,
                        tie_word_embeddings=True, bos_token_id=1, eos_token_id=(2,))
LR = 1e-4
UPDATES = 64
# 'tis': the proximal log-probs (the params at the step's start) are the old policy, so the first
# update's ratio is 1 and the arbitrary behaviour log-probs only weight the loss.
SECTION = LearnerSection(lr=LR, adv_estimator="grpo", off_policy="tis", seq_len_buckets=(16,), pack_length=0,
                         weight_decay=0.0)
NORMS = ("layers.input_layernorm.weight", "layers.post_attention_layernorm.weight", "norm.weight")  # layers: stacked


def _trajectories(version: int = 0) -> list[Trajectory]:
    return two_groups(version)


def _learner(master: bool, updates: int = UPDATES, publish_dtype="bfloat16", **kw) -> tuple[Learner, LocalPublisher]:
    model = Transformer(CFG, rngs=nnx.Rngs(0), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    section = dataclasses.replace(SECTION, master_weights=master, ppo_epochs=updates, **kw)
    pub = LocalPublisher()
    return Learner(section, model, publish_dtype=publish_dtype, publisher=pub), pub


def _served(learner: Learner, pub: LocalPublisher) -> dict[str, np.ndarray]:
    learner.flush(60)
    version, flat = pub.latest()
    assert version == learner.version
    return flat


def test_one_update_is_below_bfloat16_resolution_at_one():
    learner, _ = _learner(True, updates=1)
    before = learner.master_params()
    assert all(np.all(before[n] == 1.0) for n in NORMS)
    m = learner.step(_trajectories())
    assert m["skipped"] == 0
    after = learner.master_params()
    moved = max(float(np.abs(after[n] - before[n]).max()) for n in NORMS)
    # Half of bfloat16's step just below 1.0 is 2^-9: a bfloat16 weight would round this back to 1.0.
    assert 0.5 * LR < moved <= 1.01 * LR < 2.0 ** -9
    rounded = {n: after[n].astype(ml_dtypes.bfloat16).astype(np.float32) for n in NORMS}
    assert all(np.all(rounded[n] == 1.0) for n in NORMS)


def test_updates_below_bfloat16_resolution_accumulate_in_the_master_and_reach_the_served_weights():
    learner, pub = _learner(True)
    state = learner.state.params["actor"]
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(state))  # a bfloat16 model, float32 master
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(learner.state.opt_state) if x.ndim)
    m = learner.step(_trajectories())
    assert m["skipped"] == 0 and m["updates"] == UPDATES
    master = learner.master_params()
    served = _served(learner, pub)
    assert {v.dtype for v in served.values()} == {np.dtype(ml_dtypes.bfloat16)}
    for n in served:  # the served version is the master rounded to bfloat16, nothing else
        np.testing.assert_array_equal(served[n], master[n].astype(ml_dtypes.bfloat16), err_msg=n)
    drift = np.concatenate([np.abs(master[n] - 1.0).ravel() for n in NORMS])
    changed = np.concatenate([(served[n].astype(np.float32) != 1.0).ravel() for n in NORMS])
    assert drift.max() > 2.0 ** -8, drift.max()  # accumulated past a whole bfloat16 step at 1.0
    assert changed.mean() > 0.25, f"only {changed.sum()} of {changed.size} served norm weights moved"


def test_without_master_weights_the_same_updates_are_lost():
    """The old path (bfloat16 parameters trained directly) must lose what the master copy keeps:
    this is the run the test above would fail on without master weights."""
    learner, pub = _learner(False)
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(learner.state.params["actor"]))
    m = learner.step(_trajectories())
    assert m["skipped"] == 0 and m["updates"] == UPDATES
    served = _served(learner, pub)
    for n in NORMS:
        assert np.all(served[n].astype(np.float32) == 1.0), n


def test_bfloat16_serving_halves_the_published_bytes():
    sizes = {}
    # float32 as the master (nothing to cast); bfloat16 through the cast into device memory (CPU's
    # default) and through the snapshot program (accelerators' default; pinned host memory here).
    for dtype, snapshot in (("float32", False), ("bfloat16", False), ("bfloat16", True)):
        learner, pub = _learner(True, updates=1, publish_dtype=dtype, publish_snapshot=snapshot)
        learner.step(_trajectories())
        served = _served(learner, pub)
        assert {v.dtype.name for v in served.values()} == {dtype}
        sizes[dtype, snapshot] = sum(v.nbytes for v in served.values())
        assert {v.dtype.name for v in learner.policy_params().values()} == {dtype}  # the initial publish's copy
        learner.close()
    assert sizes["bfloat16", False] * 2 == sizes["bfloat16", True] * 2 == sizes["float32", False]


def test_served_arrays_are_the_serving_dtype_of_the_master_copy():
    """What a learner group gathers for a version it publishes outside a step (its first, a resume's)
    is `served_arrays`: the float32 master cast to the serving dtype on the devices, equal to the
    host copy `policy_params` gives (a bfloat16-serving fleet refuses a float32 version)."""
    learner, _ = _learner(True, updates=1)
    master = learner.policy_arrays()
    served = learner.served_arrays()
    assert {v.dtype.name for v in master.values()} == {"float32"}
    assert {v.dtype.name for v in served.values()} == {"bfloat16"}
    host = learner.policy_params()
    for k in host:
        np.testing.assert_array_equal(np.asarray(served[k]), host[k], err_msg=k)
    learner.close()


def test_the_store_holds_the_serving_dtype(tmp_path):
    from laminar_jax.relay import Publisher, WeightStore

    learner, _ = _learner(True, updates=1)
    store = WeightStore(str(tmp_path / "store"))
    with Publisher(store=store) as publisher:
        learner.publisher = publisher
        learner.step(_trajectories())
        learner.flush(60)
        publisher.flush(60)
    manifest = store.manifest(learner.version)
    assert {e.dtype for e in manifest.entries} == {"bfloat16"}
    master = learner.master_params()
    assert sum(e.nbytes for e in manifest.entries) * 2 == sum(v.nbytes for v in master.values()
                                                               if not v.dtype == np.int32)
    got = store.read(learner.version)
    np.testing.assert_array_equal(got["norm.weight"], master["norm.weight"].astype(ml_dtypes.bfloat16))


def test_checkpoints_hold_the_master_copy(tmp_path):
    from laminar_jax.learner.checkpoint import LayoutMismatch

    ckpt = dict(checkpoint_dir=str(tmp_path / "ckpt"), async_checkpoint=False)
    learner, _ = _learner(True, updates=8, **ckpt)
    learner.step(_trajectories())
    learner.save(1)
    learner.flush()
    want = learner.master_params()
    fresh, _ = _learner(True, updates=8, **ckpt)
    fresh.restore_latest()
    got = fresh.master_params()
    assert {v.dtype for v in got.values()} == {np.dtype(np.float32)}
    for n in want:  # bit for bit, below bfloat16's resolution included
        np.testing.assert_array_equal(got[n], want[n], err_msg=n)
    assert any(not np.all(got[n].astype(ml_dtypes.bfloat16).astype(np.float32) == got[n]) for n in NORMS)
    # A bfloat16 state (no master) is another layout: the error names a tensor and both dtypes.
    old, _ = _learner(False, updates=8, **ckpt)
    with pytest.raises(LayoutMismatch, match="is float32, the live learner's is bfloat16"):
        old.restore_latest()


def test_a_checkpoint_restores_only_into_dtypes_that_hold_it_exactly():
    from laminar_jax.learner.checkpoint import LayoutMismatch, _check_dtypes

    paths = ["['params']['w']", "['step']"]
    _check_dtypes("d", 1, ["bfloat16", "int32"], ["float32", "int32"], paths)  # no-master state -> master: exact
    _check_dtypes("d", 1, None, ["float32", "int32"], paths)  # written before dtypes were recorded
    with pytest.raises(LayoutMismatch, match=r"\['w'\] is float32, the live learner's is bfloat16"):
        _check_dtypes("d", 1, ["float32", "int32"], ["bfloat16", "int32"], paths)
    with pytest.raises(LayoutMismatch, match="is float16"):
        _check_dtypes("d", 1, ["float16", "int32"], ["bfloat16", "int32"], paths)


def test_a_server_refuses_a_version_in_another_dtype():
    from laminar_jax.learner.publish import flatten_params
    from laminar_jax.model.precision import cast_floating
    from laminar_jax.runtime.fleet import params_from_flat

    model = Transformer(CFG, rngs=nnx.Rngs(0), dtype=jnp.bfloat16, param_dtype=jnp.float32, value_head=True)
    flat = cast_floating(flatten_params(nnx.split(model)[1]), "bfloat16")  # as published: no value head
    params = params_from_flat(model, dtype="bfloat16")(flat)
    assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype(jnp.bfloat16)}  # the value head cast too
    with pytest.raises(ValueError, match="is bfloat16, this server serves float32"):
        params_from_flat(model, dtype="float32")(flat)


_FSDP_CHILD = """
import jax, jax.numpy as jnp, ml_dtypes, numpy as np
from tests.learner.test_master_weights import _learner, _served, _trajectories
learner, pub = _learner(True, updates=4)  # every device on the fsdp axis (the default mesh)
assert len(learner.mesh.devices.flat) == 8
leaves = jax.tree.leaves(learner.state.params["actor"]) + jax.tree.leaves(learner.state.opt_state)
assert all(x.dtype == jnp.float32 for x in leaves if x.ndim)
assert sum("fsdp" in str(x.sharding.spec) for x in leaves) >= 9, [x.sharding.spec for x in leaves]
assert learner.step(_trajectories())["skipped"] == 0
served, master = _served(learner, pub), learner.master_params()
for n in served:
    np.testing.assert_array_equal(served[n], master[n].astype(ml_dtypes.bfloat16), err_msg=n)
print("OK", len(served))
"""


def test_master_weights_train_sharded_over_fsdp():
    """The float32 master and its AdamW state shard over the mesh as the params did; the compute
    copy is cast inside the step; the version is cast before the host copy (8 fake CPU devices)."""
    import subprocess
    import sys

    from tests.subprocess_env import child_env

    p = subprocess.run([sys.executable, "-c", _FSDP_CHILD], capture_output=True, text=True, timeout=600,
                       env=child_env(XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu"))
    assert p.returncode == 0 and "OK" in p.stdout, p.stdout[-2000:] + p.stderr[-4000:]
