"""Placement policy (laminar_jax/placement.py): layouts over device counts, key-naming errors, memory fit."""

import dataclasses

import pytest

from laminar_jax.config import ConfigError, finalize, default_config
from laminar_jax.model.presets import PRESETS
from laminar_jax.placement import (
    Layout, PlacementSection, device_needs, fit_errors, learner_bytes_per_device, plan_layout,
    rollout_bytes_per_device)


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


def test_memory_fit_counts_each_device_and_names_the_budget():
    arch = PRESETS["qwen2.5-7b"]
    rollout = dataclasses.make_dataclass("R", [("num_pages", int), ("page_size", int)])(4097, 16)
    per_server = rollout_bytes_per_device(arch, rollout, tp=2, weight_bytes=2 * arch.num_params(), kv_itemsize=2)
    kv = 2 * 28 * 4097 * 16 * 4 * 128 * 2
    assert per_server == (2 * arch.num_params() + kv) // 2
    lay = Layout((0, 1, 2, 3), ((4, 5), (6, 7)))
    need = device_needs(lay, learner_bytes_per_device(arch.num_params(), 4), per_server)
    assert set(need) == set(range(8)) and need[0] == 4 * 4 * arch.num_params() // 4
    gib = 2**30
    assert fit_errors(need, {d: 80 * gib for d in range(8)}) == []
    errs = fit_errors(need, {d: 16 * gib for d in range(8)})
    # The learner's 4 devices hold 4 x 7.6B x 4 bytes / 4 = 28 GiB each; a TP-2 server device ~9.5 GiB.
    assert [e.split(":")[0] for e in errs] == [f"device {d}" for d in range(4)]
    assert "bytes_limit is 16.00 GiB" in errs[0] and "needs 28.3" in errs[0]
    assert fit_errors(need, {d: None for d in range(8)}) == []  # CPU: no limit reported, nothing to check
    # Colocated: one device holds the learner's share and a server's.
    both = device_needs(Layout((0,), ((0,),)), 10, 5)
    assert both == {0: 15}


class FakeDevice:
    """Stands in for a jax device's memory_stats (the only thing check_fit reads)."""

    def __init__(self, limit):
        self.limit = limit

    def memory_stats(self):
        return None if self.limit is None else {"bytes_limit": self.limit}


def test_check_fit_fails_at_start_naming_the_budget():
    from laminar_jax.config import finalize, repo_config
    from laminar_jax.placement import check_fit

    c = repo_config("gpu_node")
    cfg = finalize(c)
    arch = PRESETS["qwen2.5-7b"]
    lay = plan_layout(cfg.placement, 8, cfg.runtime.num_servers)
    weights = 4 * arch.num_params()
    check_fit(cfg, lay, [FakeDevice(80 * 2**30)] * 8, arch, weights, 2)  # fits
    check_fit(cfg, lay, [FakeDevice(None)] * 8, arch, weights, 2)  # CPU: nothing reported, nothing checked
    with pytest.raises(ConfigError, match=r"device 4: needs .* GiB .* bytes_limit is 40\.00 GiB"):
        check_fit(cfg, lay, [FakeDevice(80 * 2**30)] * 4 + [FakeDevice(40 * 2**30)] * 4, arch, weights, 2)


def test_config_json_records_the_layout_and_still_loads(tmp_path):
    import json

    from laminar_jax.config import load_config, save_config

    cfg = finalize(default_config())
    layout = {"learner": [0, 1, 2, 3], "servers": [[4, 5], [6, 7]]}
    path = save_config(cfg, str(tmp_path), layout)
    with open(path) as f:
        assert json.load(f)["realised_placement"] == layout
    assert load_config(path) == cfg
