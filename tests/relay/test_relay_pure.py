"""Pure parts of the relay plane: flat naming, manifest layout and chunking, token bucket, config."""

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from laminar_jax.configlib import ConfigError, field_docs
from laminar_jax.relay.config import RelaySection
from laminar_jax.relay.flat import flatten_tree, is_flat, unflatten_like
from laminar_jax.relay.manifest import (Manifest, ManifestError, chunk_segments, chunk_span, num_chunks,
                                        plan_layout, views)
from laminar_jax.relay.ratelimit import TokenBucket


class _Tiny(nnx.Module):
    def __init__(self):
        self.dense = nnx.Linear(3, 4, rngs=nnx.Rngs(0))
        self.extra = nnx.List([nnx.Param(jnp.ones(2)), nnx.Param(jnp.zeros((), jnp.bfloat16))])


def test_flatten_unflatten_nnx_state_roundtrip():
    state = nnx.state(_Tiny())
    flat = flatten_tree(state)
    # The project's one naming (laminar_jax.naming), as the learner publishes it.
    assert list(flat) == ["dense.bias", "dense.kernel", "extra.0", "extra.1"]
    assert flat["extra.1"].dtype == ml_dtypes.bfloat16
    assert all(isinstance(a, np.ndarray) for a in flat.values())
    assert flatten_tree(nnx.state(_Tiny())).keys() == flat.keys()  # stable across instances
    rebuilt = unflatten_like({k: v + 1 for k, v in flat.items()}, state)
    assert type(rebuilt) is type(state)
    for (p1, a), (p2, b) in zip(jax.tree_util.tree_flatten_with_path(state)[0],
                                jax.tree_util.tree_flatten_with_path(rebuilt)[0]):
        assert p1 == p2
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a) + 1)


def test_flatten_nested_dict_names_and_idempotence():
    tree = {"b": [np.ones(2), np.zeros(3)], "a": {"w": np.arange(4.0)}}
    flat = flatten_tree(tree)
    assert list(flat) == ["a.w", "b.0", "b.1"]  # the one naming (laminar_jax.naming)
    assert is_flat(flat) and flatten_tree(flat).keys() == flat.keys()
    back = unflatten_like(flat, tree)
    np.testing.assert_array_equal(back["a"]["w"], tree["a"]["w"])


def test_unflatten_like_errors_name_the_weight():
    tree = {"a": {"w": np.zeros((2, 2))}}
    with pytest.raises(KeyError, match=r"a.*w.* required by the template is missing"):
        unflatten_like({"x": np.zeros(1)}, tree)
    with pytest.raises(ValueError, match=r"shape \(3,\)"):
        unflatten_like({"a.w": np.zeros(3)}, tree)
    with pytest.raises(KeyError, match="not in the template"):
        unflatten_like({"a.w": np.zeros((2, 2)), "extra": np.zeros(1)}, tree)


def _flat():
    rng = np.random.default_rng(0)
    return {"w": rng.random((5, 7), dtype=np.float32), "b": rng.random(3).astype(ml_dtypes.bfloat16),
            "s": np.array(7, np.int64), "e": np.zeros((0, 3), np.float32), "h": rng.random(11).astype(np.float16)}


def test_layout_packs_aligned_and_roundtrips_json():
    flat = _flat()
    m = plan_layout(flat, 3)
    assert all(e.offset % 64 == 0 for e in m.entries)
    m2 = Manifest.from_json(m.to_json(), "test")
    assert m2 == m
    packed = bytearray(m.total_bytes)
    for e in m.entries:
        packed[e.offset:e.offset + e.nbytes] = flat[e.name].tobytes()
    back = views(bytes(packed), m)
    for k in flat:
        assert back[k].dtype == flat[k].dtype and back[k].shape == flat[k].shape
        assert back[k].tobytes() == flat[k].tobytes()


@pytest.mark.parametrize("chunk", [64, 100, 4096, 1 << 20])
def test_chunk_segments_concatenate_to_the_packed_buffer(chunk):
    flat = _flat()
    m = plan_layout(flat, 1)
    packed = bytearray(m.total_bytes)
    for e in m.entries:
        packed[e.offset:e.offset + e.nbytes] = flat[e.name].tobytes()
    pairs = [(e, flat[e.name]) for e in m.entries]
    rebuilt = b""
    for i in range(num_chunks(m.total_bytes, chunk)):
        start, stop = chunk_span(i, m.total_bytes, chunk)
        rebuilt += b"".join(bytes(s) for s in chunk_segments(pairs, start, stop))
    assert rebuilt == bytes(packed)


def test_manifest_rejects_bad_fields_by_name():
    d = plan_layout(_flat(), 1).to_dict()
    d["entries"][1]["nbytes"] += 1
    with pytest.raises(ManifestError, match=r"entries\[1\]\.nbytes"):
        Manifest.from_dict(d, "m.json")
    with pytest.raises(ManifestError, match=r"\['x'\].*np.ndarray"):
        plan_layout({"x": [1, 2]}, 1)
    with pytest.raises(ManifestError, match="little-endian"):
        plan_layout({"x": np.zeros(2, ">f4")}, 1)


class _FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t

    def sleep(self, s):
        self.t += s


def test_token_bucket_long_run_rate_and_burst():
    clock = _FakeClock()
    tb = TokenBucket(rate=100.0, burst=50.0, clock=clock, sleep=clock.sleep)
    for _ in range(100):
        tb.acquire(10)
    # 1000 bytes at 100 B/s with a 50-byte head start: (1000 - 50) / 100 seconds
    assert clock.t == pytest.approx(9.5)
    clock.t += 100.0  # idle: tokens cap at the burst, not 100 s worth
    assert tb.reserve(50) == 0.0
    assert tb.reserve(10) == pytest.approx(0.1)


def test_config_documents_and_validates_every_field():
    docs = field_docs(RelaySection)
    assert set(docs) == {f.name for f in dataclasses.fields(RelaySection)}
    RelaySection().validate("relay")
    with pytest.raises(ConfigError, match=r"relay\.keep_last"):
        RelaySection(keep_last=0).validate("relay")
    with pytest.raises(ConfigError, match=r"relay\.relay_addresses\[1\]"):
        RelaySection(relay_addresses=("127.0.0.1:1", "nohost")).validate("relay")
