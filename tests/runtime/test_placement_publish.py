"""A learner on a sub-mesh (devices 4-7 of 8) publishes exact weights from its FSDP shards.

The host copy is per shard (HostCopy: copy_to_host_async + np.asarray of each sharded array), so no
device holds the whole model for it; XLA:CPU does not report device-to-device transfers (its
transfer guard does not fire), so this checks the result and the sharding, not the absence of a gather.
"""

import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CODE = textwrap.dedent("""
    import jax, numpy as np
    from flax import nnx
    from laminar_jax.learner.config import LearnerSection, MeshSection
    from laminar_jax.learner.learner import Learner
    from laminar_jax.learner.mesh import build_mesh
    from laminar_jax.learner.publish import HostCopy, LocalPublisher, flatten_params, model_params
    from laminar_jax.model import PRESETS, Transformer

    model = Transformer(PRESETS["tiny"], rngs=nnx.Rngs(0))
    want = model_params(model)
    learner = Learner(LearnerSection(), model, build_mesh(MeshSection(), jax.devices()[4:8]))
    flat = flatten_params(learner.state.params["actor"])
    devices = {d.id for x in flat.values() for d in x.sharding.device_set}
    split = [k for k, x in flat.items() if x.addressable_shards[0].data.shape != x.shape]
    pub = LocalPublisher()
    HostCopy(1, flat, pub).wait_done(60)
    version, got = pub.latest()
    assert version == 1 and devices == {4, 5, 6, 7}, devices
    # FSDP-sharded, not replicated: the table and every layer matrix (stacked under the layers' scan)
    matrices = [k for k, x in flat.items() if x.ndim - k.startswith("layers.") >= 2]
    assert len(matrices) >= 8 and sorted(split) == sorted(matrices), (split, matrices)
    for k, v in got.items():
        np.testing.assert_array_equal(v, want[k], err_msg=k)
    print("OK", len(split), "sharded leaves published")
""")


def test_learner_on_a_sub_mesh_publishes_exact_weights_from_its_shards():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-c", CODE], env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert p.returncode == 0 and "OK" in p.stdout, p.stdout[-2000:] + p.stderr[-4000:]
