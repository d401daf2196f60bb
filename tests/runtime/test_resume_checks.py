"""Resuming a run directory: a changed config that breaks the ledger's meaning is refused naming the
key; an allowed change is logged; no checkpoint means a logged fresh start."""

import logging

import pytest

from laminar_jax.config import ConfigError, finalize, repo_config, save_config
from laminar_jax.runtime.parts import check_resume, resolve


def _cfg(tmp_path, **runtime):
    c = repo_config("demo", "short")
    c.runtime.update(run_dir=str(tmp_path / "run"), **runtime)
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
