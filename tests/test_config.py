"""Config tree: defaults validate, overrides are typed, errors name the dotted key, JSON round-trips."""

import dataclasses
import importlib.util
import os

import pytest

from laminar_jax.config import ConfigError, default_config, finalize, load_config, save_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load(path):
    spec = importlib.util.spec_from_file_location("cfgmod", os.path.join(ROOT, path))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("path", sorted(f"configs/{f}" for f in os.listdir(os.path.join(ROOT, "configs"))
                                        if f.endswith(".py")))
def test_every_config_file_finalizes(path):
    cfg = finalize(_load(path).get_config(""))
    assert cfg.runtime.mode in ("sync", "one_step", "stream", "laminar")


def test_unknown_key_is_named():
    cd = default_config().to_dict()
    cd["learner"]["lrr"] = 1.0
    with pytest.raises(ConfigError, match=r"learner\.lrr: unknown key"):
        finalize(cd)


def test_bad_value_names_key_value_and_expectation():
    cd = default_config()
    cd.runtime.num_servers = 0
    with pytest.raises(ConfigError, match=r"runtime\.num_servers=0: must be >= 1"):
        finalize(cd)
    cd = default_config().to_dict()
    cd["runtime"]["mode"] = "fast"
    with pytest.raises(ConfigError, match=r"runtime\.mode='fast': must be one of"):
        finalize(cd)
    cd = default_config().to_dict()
    cd["rollout"]["top_p"] = 1.5
    with pytest.raises(ConfigError, match=r"rollout\.top_p=1\.5"):
        finalize(cd)
    cd = default_config()
    cd.learner.pack_rows_per_doubling = 0
    with pytest.raises(ConfigError, match=r"learner\.pack_rows_per_doubling=0: must be >= 1"):
        finalize(cd)
    cd = default_config()
    cd.learner.mini_batch_draw = "sorted"
    with pytest.raises(ConfigError, match=r"learner\.mini_batch_draw='sorted': must be one of"):
        finalize(cd)


def test_optional_fields_accept_overrides_and_types_are_checked():
    cd = default_config()
    cd.model.path = "/some/hf/dir"  # placeholder typed as str
    with pytest.raises(TypeError):
        cd.runtime.num_servers = "two"


def test_resolved_config_roundtrips_through_json(tmp_path):
    cfg = finalize(default_config())
    path = save_config(cfg, str(tmp_path))
    assert load_config(path) == cfg
    changed = dataclasses.replace(cfg, seed=7)
    assert load_config(save_config(changed, str(tmp_path))).seed == 7
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ConfigError, match="bad.json: not valid JSON"):
        load_config(str(tmp_path / "bad.json"))


def test_finalize_derives_linked_values_once(tmp_path):
    from laminar_jax.config import default_config, finalize

    c = default_config()
    c.runtime.total_steps, c.learner.ppo_epochs, c.learner.mini_batches = 10, 2, 4
    cfg = finalize(c)
    assert cfg.learner.total_steps == 80  # optimizer updates the lr schedule spans
    from laminar_jax.config import replace
    from laminar_jax.runtime.parts import resolve

    assert replace(cfg, **{"runtime.total_steps": 5}).learner.total_steps == 40  # re-derived, never stale
    resolved, resuming = resolve(cfg, str(tmp_path / "run"))
    assert resolved.learner.checkpoint_dir == str(tmp_path / "run" / "checkpoints") and not resuming
    c.runtime.mode, c.buffer.max_staleness = "stream", None
    import pytest
    from laminar_jax.config import ConfigError

    with pytest.raises(ConfigError, match="buffer.max_staleness"):
        finalize(c)
def test_serving_dtype_follows_the_model_dtype_unless_set():
    cd = default_config()
    cd.model.dtype = "bfloat16"
    assert finalize(cd).rollout.dtype == "bfloat16"  # derived: serve what the model computes in
    cd.rollout.dtype = "float32"
    assert finalize(cd).rollout.dtype == "float32"
    cd.rollout.dtype = "int8"
    with pytest.raises(ConfigError, match=r"rollout\.dtype"):
        finalize(cd)
    for variant in ("", "32b", "0.5b"):  # the GPU node serves bfloat16 and trains float32 masters
        cfg = finalize(_load("configs/gpu_node.py").get_config(variant))
        assert cfg.rollout.dtype == "bfloat16" and cfg.learner.master_weights


def test_pack_length_follows_max_total_len_unless_set():
    cd = default_config()
    cd.rollout.max_prompt_len, cd.rollout.max_total_len, cd.rollout.num_pages = 256, 768, 1000
    assert finalize(cd).learner.pack_length == 768  # derived: the longest trajectory fits
    cd.learner.pack_length = 0
    assert finalize(cd).learner.pack_length == 0  # explicitly off
    cd.learner.pack_length = 192  # explicitly too short for a 768-token trajectory
    with pytest.raises(ConfigError, match=r"learner\.pack_length=192: must be >= rollout\.max_total_len=768"):
        finalize(cd)
