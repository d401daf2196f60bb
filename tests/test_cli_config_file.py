"""A --config that is missing, a directory or not a .py file is one 'config error' line naming the
path and exit 2, for every entry point (absl ones through laminar_jax.cli.run_app, and plan.py)."""

import os
import subprocess
import sys

import pytest

from laminar_jax.cli import config_arg, config_file_error, load_config_module
from laminar_jax.configlib import ConfigError
from tests.subprocess_env import child_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_config_file_error_names_the_path(tmp_path):
    (tmp_path / "cfg.yaml").write_text("a: 1\n")
    (tmp_path / "nocfg.py").write_text("X = 1\n")
    assert config_file_error(str(tmp_path / "nope.py")) == f"--config: {tmp_path / 'nope.py'}: no such file"
    assert "is a directory" in config_file_error(str(tmp_path))
    assert "not a .py config file" in config_file_error(f"{tmp_path / 'cfg.yaml'}:short")
    assert config_file_error("configs/demo.py:short") is None
    assert config_file_error("configs/demo.py:short", variant=False).endswith("no such file")
    with pytest.raises(ConfigError, match="nocfg.py: defines no get_config"):
        load_config_module(str(tmp_path / "nocfg.py"))
    assert config_arg(["--steps=1", "--config", "a.py", "--config.x=1"]) == "a.py"
    assert config_arg(["--config=b.py:v", "--config.seed=2"]) == "b.py:v"
    assert config_arg(["--config.seed=2"]) is None


def _cli(args, cwd):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120, cwd=cwd,
                          env=child_env(JAX_PLATFORMS="cpu"))


@pytest.mark.parametrize("entry", [["launch/plan.py"], ["launch/plan.py", "memory"], ["launch/run.py"]])
def test_entry_points_refuse_a_missing_or_non_py_config_in_one_line(entry, tmp_path):
    (tmp_path / "cfg.json").write_text("{}")
    for value, says in ((str(tmp_path / "missing.py"), "no such file"),
                        (str(tmp_path / "cfg.json"), "not a .py config file")):
        p = _cli([os.path.join(ROOT, entry[0]), *entry[1:], f"--config={value}"], cwd=str(tmp_path))
        assert p.returncode == 2, p.stderr[-2000:]
        lines = p.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"config error: --config: {value}: {says}"), p.stderr[-2000:]
