"""Sharded learner step == single-device step: fake 8-device CPU mesh, and 2 processes x 4 devices.

Tolerances (float32 on CPU; only the reduction order differs between layouts):
  loss, advantages: rtol 1e-5 / atol 1e-6; gradients: atol 1e-6 (largest |g| ~ 0.5);
  parameters after one AdamW update (lr 1e-3, adam_eps 1e-4): atol 1e-5. adam_eps is raised in the
  worker because Adam divides by |g|: with eps=1e-8 a 1e-7 gradient difference on a ~0 gradient
  moves the update by up to lr; with eps=1e-4 it moves it by <= lr * 1e-7 / 1e-4.
"""

import os
import socket
import subprocess
import sys

import numpy as np
import pytest

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "learner_mesh_worker.py")


def _env(n_devices: int) -> dict:
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={n_devices}"
    env["JAX_PLATFORMS"] = "cpu"
    return env


def _run(args, n_devices, timeout=240):
    p = subprocess.run([sys.executable, WORKER, *args], env=_env(n_devices), capture_output=True, text=True,
                       timeout=timeout)
    assert p.returncode == 0, f"worker failed (rc={p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}"
    return p


def _compare(ref_path, got_path):
    ref, got = np.load(ref_path), np.load(got_path)
    assert set(ref.files) == set(got.files)
    np.testing.assert_allclose(got["loss"], ref["loss"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got["step_loss"], ref["step_loss"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got["advantages"], ref["advantages"], rtol=1e-5, atol=1e-5)
    grads = [k for k in ref.files if k.startswith("grad/")]
    params = [k for k in ref.files if k.startswith("param/")]
    assert len(grads) == len(params) > 10
    for k in grads:
        np.testing.assert_allclose(got[k], ref[k], rtol=0, atol=1e-6, err_msg=k)
    for k in params:
        np.testing.assert_allclose(got[k], ref[k], rtol=0, atol=1e-5, err_msg=k)
    assert max(float(np.abs(ref[k]).max()) for k in grads) > 1e-3  # a real gradient, not all zeros


@pytest.fixture(scope="module")
def mesh_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("mesh")
    _run(["--mesh", "1,1,1:1", "--mesh", "1,8,1", "--mesh", "2,2,2", "--mesh", "2,2,2+chunked",
          "--out", str(out)], 8)
    return out


def _spec(path, key):
    return str(np.load(path)[key])


def test_fsdp8_matches_single_device(mesh_results):
    _compare(mesh_results / "mesh_1_1_1.npz", mesh_results / "mesh_1_8_1.npz")
    # embedding ('vocab', 'embed'): embed -> fsdp; params and Adam moments really are sharded
    for key in ("spec_embed", "spec_mu_embed"):
        assert _spec(mesh_results / "mesh_1_8_1.npz", key) == "(None, 'fsdp')"
        assert _spec(mesh_results / "mesh_1_1_1.npz", key) in ("()", "(None, None)")


def test_data2_fsdp2_tensor2_matches_single_device(mesh_results):
    _compare(mesh_results / "mesh_1_1_1.npz", mesh_results / "mesh_2_2_2.npz")
    for key in ("spec_embed", "spec_mu_embed"):
        assert _spec(mesh_results / "mesh_2_2_2.npz", key) == "('tensor', 'fsdp')"


def test_chunked_logits_and_remat_on_a_mesh_match_single_device(mesh_results):
    """learner.remat='full' + logits_chunk_tokens=16 on data2 x fsdp2 x tensor2 (rows and vocab sharded
    inside the chunk scan) against the unchunked, no-remat single-device step; same tolerances."""
    _compare(mesh_results / "mesh_1_1_1.npz", mesh_results / "mesh_2_2_2_chunked.npz")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_match_single_process(mesh_results, tmp_path):
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, WORKER, "--mesh", "2,2,2", "--out", str(tmp_path),
                               "--num-processes", "2", "--process-id", str(i), "--port", str(port)],
                              env=_env(4), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    logs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=300)
            logs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for i, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0, f"process {i} failed (rc={p.returncode}):\n{log[-5000:]}"
    _compare(mesh_results / "mesh_1_1_1.npz", tmp_path / "mesh_2_2_2.npz")
    assert _spec(tmp_path / "mesh_2_2_2.npz", "spec_embed") == "('tensor', 'fsdp')"
