"""Executes colab/laminar_demo.ipynb headless with its default parameters (tiny model, synthetic task).

The kernel is the current interpreter: a temporary kernelspec named "python3" pointing at
sys.executable is put first on the Jupyter path, so the test never picks up a system kernel.
"""

import json
import os
import sys

import numpy as np
import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NOTEBOOK = os.path.join(ROOT, "colab", "laminar_demo.ipynb")


def _kernelspec(data_dir: str) -> None:
    spec_dir = os.path.join(data_dir, "kernels", "python3")
    os.makedirs(spec_dir)
    with open(os.path.join(spec_dir, "kernel.json"), "w") as f:
        json.dump({"argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                   "display_name": "Python 3 (test)", "language": "python"}, f)


def _outputs(nb, kind: str):
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            if out.get("output_type") == kind:
                yield cell, out


def test_notebook_is_a_plain_library_client():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    params = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(params) == 1 and nb.cells.index(params[0]) <= 2, "one 'parameters' cell, near the top"
    assert 'MODEL = "tiny"' in params[0].source and 'TASK = "synthetic_skew"' in params[0].source
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert not any(c.get("outputs") for c in code), "commit the notebook without outputs"
    assert not any(("def " in c.source or "class " in c.source) for c in code), "no logic of its own"


# Slow (~100 s on 2 cores: the notebook trains laminar and sync, each compiling its own programs); the
# same runs are covered in the default tier by tests/runtime/test_local_runtime.py.
@pytest.mark.slow
def test_notebook_runs_headless(tmp_path, monkeypatch):
    data_dir = tmp_path / "jupyter"
    _kernelspec(str(data_dir))
    monkeypatch.setenv("JUPYTER_DATA_DIR", str(data_dir))
    monkeypatch.setenv("JUPYTER_PATH", str(data_dir))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    work = tmp_path / "work"
    work.mkdir()
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(nb, kernel_name="python3", timeout=600,
                                     resources={"metadata": {"path": str(work)}})
    client.execute()

    lines = [line for _, out in _outputs(nb, "stream") for line in out.get("text", "").splitlines()
             if line.startswith("DEMO_RESULT ")]
    assert len(lines) == 1, "the last cell prints one DEMO_RESULT line"
    res = json.loads(lines[0][len("DEMO_RESULT "):])

    # A reward curve with one finite point per learner step (configs/demo.py:short runs 4 steps).
    curve = res["reward_curve"]
    assert len(curve) == 4
    times = [t for t, _ in curve]
    assert times == sorted(times)
    assert all(0.0 <= r <= 1.0 for _, r in curve)
    assert res["modes"] == ["laminar", "sync"]
    pngs = [out for _, out in _outputs(nb, "display_data") if "image/png" in out.get("data", {})]
    assert len(pngs) == 4, "reward/staleness plot, laminar timeline, comparison plot, sync timeline"
    for cell in nb.cells:
        if "plt.show()" in cell.source:
            assert any("image/png" in o.get("data", {}) for o in cell.outputs), f"no figure from:\n{cell.source}"

    # The export loads back with from_pretrained and holds the trained policy: the newest version
    # the learner published, which differs from the model it started from.
    from flax import nnx

    from laminar_jax.config import load_config
    from laminar_jax.learner.publish import flatten_params
    from laminar_jax.model import build_model, from_pretrained
    from laminar_jax.relay import WeightStore

    export_dir = res["export_dir"]
    assert os.path.exists(os.path.join(export_dir, "config.json"))
    reloaded = from_pretrained(export_dir)
    got = {k: np.asarray(v) for k, v in flatten_params(nnx.state(reloaded, nnx.Param)).items()}
    run_dir = os.path.join(str(work), res["run_dir"]) if not os.path.isabs(res["run_dir"]) else res["run_dir"]
    cfg = load_config(os.path.join(run_dir, "config.json"))
    store = WeightStore(os.path.join(run_dir, "weights"))
    assert store.latest() == 4
    trained = store.read(store.latest())
    assert sorted(got) == sorted(trained)
    for name, value in trained.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)
    init = {k: np.asarray(v) for k, v in flatten_params(nnx.state(build_model(cfg.model), nnx.Param)).items()}
    assert any(not np.array_equal(init[k], trained[k]) for k in trained), "export equals the untrained init"
    assert res["reload_max_abs_diff"] is not None and res["reload_max_abs_diff"] <= 1e-5
