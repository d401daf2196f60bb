"""Placement policy (laminar_jax/placement.py): layouts over device counts, key-naming errors (the memory fit:
tests/test_plan_memory.py)."""

import pytest

from laminar_jax.config import ConfigError, finalize, default_config
from laminar_jax.placement import PlacementSection, plan_layout


def test_disaggregated_splits_learner_then_servers():
    lay = plan_layout(PlacementSection(learner_devices=4, rollout_tp=2, colocate=False), 8, num_servers=99)
    assert lay.to_json() == {"learner": [0, 1, 2, 3], "servers": [[4, 5], [6, 7]]}
    assert not lay.overlap()
    lay = plan_layout(PlacementSection(learner_devices=4, rollout_tp=1, colocate=False), 8, num_servers=2)
    assert lay.servers == ((4,), (5,), (6,), (7,))  # num_servers derived: (8 - 4) / 1


def test_colocated_shares_devices_round_robin():
    lay = plan_layout(PlacementSection(), 8, num_servers=2)
    assert lay.learner == tuple(range(8)) and lay.servers == ((0,), (1,))
    lay = plan_layout(PlacementSection(rollout_tp=4), 8, num_servers=3)
    assert lay.servers == ((0, 1, 2, 3), (4, 5, 6, 7), (0, 1, 2, 3))
    assert lay.overlap()
    assert plan_layout(PlacementSection(), 1, num_servers=2).servers == ((0,), (0,))  # one GPU, as today


@pytest.mark.parametrize("section,n,key", [
    (PlacementSection(learner_devices=9), 8, "placement.learner_devices"),
    (PlacementSection(learner_devices=8, colocate=False), 8, "placement.learner_devices"),
    (PlacementSection(learner_devices=3, rollout_tp=2, colocate=False), 8, "placement.rollout_tp"),
    (PlacementSection(rollout_tp=3), 8, "placement.rollout_tp"),
])
def test_counts_that_do_not_fit_name_the_key(section, n, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        plan_layout(section, n, num_servers=2)


def test_section_validation_names_the_key():
    c = default_config()
    c.placement.colocate = False
    with pytest.raises(ConfigError, match=r"placement\.learner_devices"):
        finalize(c)
    c.placement.learner_devices = 4
    c.placement.rollout_tp = 0
    with pytest.raises(ConfigError, match=r"placement\.rollout_tp"):
        finalize(c)
    c.placement.rollout_tp = 2
    assert finalize(c).placement == PlacementSection(learner_devices=4, rollout_tp=2, colocate=False)


def test_config_json_records_the_layout_and_still_loads(tmp_path):
    import json

    from laminar_jax.config import load_config, save_config

    cfg = finalize(default_config())
    layout = {"learner": [0, 1, 2, 3], "servers": [[4, 5], [6, 7]]}
    path = save_config(cfg, str(tmp_path), layout)
    with open(path) as f:
        assert json.load(f)["realised_placement"] == layout
    assert load_config(path) == cfg
