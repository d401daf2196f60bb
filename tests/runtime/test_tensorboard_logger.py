"""The TensorBoard logger starts without importing torch (tensorboardX would, ~1.7 s of start-up),
writes its events, and leaves torch importable afterwards."""

import subprocess
import sys

import pytest

from tests.subprocess_env import child_env

_PROG = r"""
import os, sys
from laminar_jax.monitor.loggers import TensorBoardLogger
log = TensorBoardLogger(sys.argv[1])
log.add_scalar("train/reward", 0.5, 1)
log.close()
print("TORCH_AFTER_LOGGER", "torch" in sys.modules)
import torch
print("TORCH_IMPORTS", torch.__name__)
print("EVENTS", sum(f.startswith("events.out.tfevents") for f in os.listdir(os.path.join(sys.argv[1], "tb"))))
"""


def test_tensorboard_logger_does_not_import_torch(tmp_path):
    pytest.importorskip("torch")  # the case only exists where torch is installed
    out = subprocess.run([sys.executable, "-c", _PROG, str(tmp_path)], capture_output=True, text=True,
                         timeout=120, env=child_env(JAX_PLATFORMS="cpu"))
    assert out.returncode == 0, out.stderr[-2000:]
    assert "TORCH_AFTER_LOGGER False" in out.stdout, out.stdout
    assert "TORCH_IMPORTS torch" in out.stdout and "EVENTS 1" in out.stdout, out.stdout
