"""Resuming a run directory: a changed config that breaks the ledger's meaning is refused naming the
key; an allowed change is logged; no checkpoint means a logged fresh start."""

import logging
import re

import pytest

from laminar_jax.config import ConfigError, finalize, repo_config, save_config
from laminar_jax.runtime.parts import check_resume, resolve


def _cfg(tmp_path, variant="short", lora=None, **runtime):
    c = repo_config("demo", variant)
    c.runtime.update(run_dir=str(tmp_path / "run"), **runtime)
    c.learner.lora.update(**(lora or {}))
    return finalize(c)


def test_a_resume_refuses_a_ledger_breaking_change_and_logs_the_rest(tmp_path, caplog):
    first = _cfg(tmp_path)
    run_dir = first.runtime.run_dir
    save_config(resolve(first, run_dir)[0], run_dir)
    with pytest.raises(ConfigError, match=r"runtime.samples_per_prompt: 4 -> 8 cannot change on resume"):
        check_resume(_cfg(tmp_path, samples_per_prompt=8), run_dir)
    with caplog.at_level(logging.WARNING):
        check_resume(_cfg(tmp_path, total_steps=9), run_dir)  # a longer run is fine
    assert "runtime.total_steps" in caplog.text
    assert "no checkpoint" in caplog.text  # and it says it starts from scratch


def test_a_fresh_run_dir_needs_no_check(tmp_path):
    cfg = _cfg(tmp_path)
    check_resume(cfg, cfg.runtime.run_dir)  # nothing saved there yet


def test_a_resume_refuses_another_lora_shape_or_scale(tmp_path, caplog):
    """The adapters in the checkpoint were trained at the saved rank, scale and modules."""
    first = _cfg(tmp_path, "lora", lora={"rank": 8, "alpha": 16.0, "targets": ("q_proj", "v_proj", "up_proj")})
    run_dir = first.runtime.run_dir
    save_config(resolve(first, run_dir)[0], run_dir)
    base = {"rank": 8, "alpha": 16.0, "targets": ("q_proj", "v_proj", "up_proj")}
    with pytest.raises(ConfigError, match=r"learner.lora.alpha: 16.0 -> 32.0 cannot change on resume \(the adapters "
                                          r"were trained at the old scale"):
        check_resume(_cfg(tmp_path, "lora", lora={**base, "alpha": 32.0}), run_dir)
    for change, shown in [({"rank": 16}, "rank: 8 -> 16"), ({"rank": 0}, "rank: 8 -> 0"),
                          ({"targets": ("q_proj", "v_proj")},
                           "targets: ['q_proj', 'v_proj', 'up_proj'] -> ['q_proj', 'v_proj']")]:
        with pytest.raises(ConfigError, match=re.escape(f"learner.lora.{shown} cannot change on resume")):
            check_resume(_cfg(tmp_path, "lora", lora={**base, **change}), run_dir)
    with caplog.at_level(logging.WARNING):
        check_resume(_cfg(tmp_path, "lora", lora={**base, "dropout": 0.25}), run_dir)  # a training knob: logged
    assert "learner.lora.dropout:" in caplog.text and "-> 0.25" in caplog.text
