"""Weights go straight to their shards: an HF checkpoint read tensor by tensor onto a learner mesh
and a rollout TP mesh (8 fake CPU devices, in a subprocess), and clear errors for a checkpoint that
does not match its config."""

import json
import os
import subprocess
import sys

import pytest

from tests.subprocess_env import child_env

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sharded_load_worker.py")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from tests.model.hf_fixtures import save_hf_model

    path = str(tmp_path_factory.mktemp("hf") / "qwen2")
    save_hf_model("qwen2", path)
    return path


def test_each_device_reads_and_holds_only_its_shards(hf_dir):
    env = child_env(XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    p = subprocess.run([sys.executable, WORKER, hf_dir], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, f"worker failed:\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}"
    assert p.stdout.count("ok ") == 2, p.stdout


def _edit_config(src: str, dst: str, **changes) -> str:
    import shutil

    shutil.copytree(src, dst)
    with open(os.path.join(dst, "config.json")) as f:
        cfg = json.load(f)
    cfg.update(changes)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    return dst


def test_a_tensor_of_the_wrong_shape_names_it_and_both_shapes(hf_dir, tmp_path):
    from laminar_jax.model import from_pretrained
    from laminar_jax.model.sharded import CheckpointMismatchError

    bad = _edit_config(hf_dir, str(tmp_path / "bad"), intermediate_size=64)
    with pytest.raises(CheckpointMismatchError, match=r"'model\.layers\.0\.mlp\.down_proj\.weight' has shape "
                                                      r"\(48, 96\), the config expects \(48, 64\)"):
        from_pretrained(bad)


def test_a_tensor_of_the_wrong_dtype_names_it(hf_dir, tmp_path):
    from laminar_jax.model import from_pretrained
    from laminar_jax.model.sharded import CheckpointMismatchError

    bad = _edit_config(hf_dir, str(tmp_path / "bf16"), torch_dtype="bfloat16")
    with pytest.raises(CheckpointMismatchError, match=r"tensor '[^']+' has dtype float32 \(shape \(\d+(, \d+)*\)\), "
                                                      r"config.json says torch_dtype=bfloat16"):
        from_pretrained(bad)
