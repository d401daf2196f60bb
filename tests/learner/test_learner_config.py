"""LearnerSection / MeshSection: documented, validated, round-trip through ConfigDict; mesh rules."""

import dataclasses

import pytest

from laminar_jax.configlib import ConfigError, field_docs, from_config_dict, to_config_dict
from laminar_jax.learner import LearnerSection, MeshSection
from laminar_jax.learner.mesh import logical_to_spec, parse_rules, resolve_mesh_shape


@pytest.mark.parametrize("cls", [LearnerSection, MeshSection])
def test_every_field_documented_and_round_trips(cls):
    docs = field_docs(cls)
    assert set(docs) == {f.name for f in dataclasses.fields(cls)}
    obj = cls()
    obj.validate("x")
    assert from_config_dict(cls, to_config_dict(obj)) == obj


@pytest.mark.parametrize("change,key", [
    (dict(adv_estimator="gae", critic="none"), "learner.adv_estimator"),
    (dict(dual_clip_c=0.5), "learner.dual_clip_c"),
    (dict(micro_batches=0), "learner.micro_batches"),
    (dict(seq_len_buckets=(64, 32)), "learner.seq_len_buckets"),
    (dict(tis_cap=0.5), "learner.tis_cap"),
])
def test_learner_section_errors_name_the_field(change, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        dataclasses.replace(LearnerSection(), **change).validate("learner")


def test_mesh_section_and_rules():
    with pytest.raises(ConfigError, match=r"mesh\.rules\[0\]"):
        MeshSection(rules=("embed:fsdp",)).validate("mesh")
    with pytest.raises(ConfigError, match="at most one axis"):
        MeshSection(data=-1, fsdp=-1).validate("mesh")
    assert resolve_mesh_shape(MeshSection(data=2, fsdp=-1, tensor=2), 8) == (2, 2, 2)
    with pytest.raises(ValueError, match="devices"):
        resolve_mesh_shape(MeshSection(data=3, fsdp=-1), 8)
    rules = parse_rules(MeshSection().rules)
    assert rules["embed"] == "fsdp" and rules["norm"] is None

    class FakeMesh:  # logical_to_spec only reads mesh.shape
        shape = {"data": 2, "fsdp": 4, "tensor": 2}

    assert tuple(logical_to_spec(("vocab", "embed"), (128, 64), rules, FakeMesh)) == ("tensor", "fsdp")
    assert tuple(logical_to_spec(("embed", None), (64, 1), rules, FakeMesh)) == ("fsdp", None)
    # not divisible -> replicated; an axis is used at most once per parameter
    assert tuple(logical_to_spec(("vocab", "embed"), (97, 6), rules, FakeMesh)) == (None, None)
    assert tuple(logical_to_spec(("heads", "mlp"), (8, 8), rules, FakeMesh)) == ("tensor", None)
