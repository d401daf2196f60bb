"""learner.balance_tokens: each mini-batch's rows are ordered so the data-parallel ranks get
near-equal token counts, and the update stays the same (membership of every mini-batch unchanged)."""

import os
import subprocess
import sys

import numpy as np

from laminar_jax.learner.learner import balance_ranks, rank_imbalance


def test_balance_ranks_evens_tokens_per_rank_and_keeps_mini_batches():
    rng = np.random.default_rng(0)
    row_tokens = np.concatenate([rng.integers(900, 1000, 4), rng.integers(10, 50, 28)])  # a long tail up front
    perm = np.arange(32)  # 2 mini-batches of 16 rows, 4 ranks x 4 rows each
    before = rank_imbalance(perm, row_tokens, 16, 4)
    balanced = balance_ranks(perm, row_tokens, 16, 4)
    after = rank_imbalance(balanced, row_tokens, 16, 4)
    print(f"max/min tokens per rank: contiguous {before:.2f}, balanced {after:.2f}")
    assert before > 10 and after < 1.5
    for j in range(2):  # same rows in each mini-batch, each once
        assert sorted(balanced[j * 16:(j + 1) * 16]) == list(range(j * 16, (j + 1) * 16))


SCRIPT = r"""
import os, sys, dataclasses
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
sys.path.insert(0, sys.argv[1]); sys.path.insert(0, os.path.join(sys.argv[1], "tests", "learner"))
import jax, numpy as np
from flax import nnx
from jax.sharding import Mesh
from test_learner_packing import _batch
from laminar_jax.learner import Learner, LearnerSection, LocalPublisher
from laminar_jax.model import PRESETS, Transformer
sec = LearnerSection(lr=1e-3, adv_estimator="grpo", mini_batches=2, micro_batches=2, loss_agg="seq-mean-token-mean",
                     seq_len_buckets=(64,), balance_tokens=False)
mesh = Mesh(np.asarray(jax.devices()).reshape(1, 4, 1), ("data", "fsdp", "tensor"))
out = {}
for balance in (False, True):
    # The balanced learner also publishes from a snapshot (forced: the default on accelerators),
    # which writes the fsdp-sharded weights into pinned host memory.
    pub = LocalPublisher(keep=2) if balance else None
    learner = Learner(dataclasses.replace(sec, balance_tokens=balance, publish_snapshot=balance),
                      Transformer(PRESETS["tiny"], rngs=nnx.Rngs(0)), mesh=mesh, publisher=pub)
    ms = [learner.step(_batch(s, n=16)) for s in range(2)]
    out[balance] = ([m["loss"] for m in ms], max(m["rank_token_imbalance"] for m in ms), learner.policy_params())
    learner.flush()
assert pub.versions == [1, 2], pub.versions
for k, v in out[True][2].items():
    np.testing.assert_array_equal(pub._versions[2][k], v, err_msg=k)
np.testing.assert_allclose(out[True][0], out[False][0], rtol=1e-5)
for k in out[True][2]:
    np.testing.assert_allclose(out[True][2][k], out[False][2][k], atol=1e-5, err_msg=k)
print("IMBALANCE", out[False][1], out[True][1])
assert out[True][1] < out[False][1], (out[True][1], out[False][1])
print("BALANCE_OK")
"""


def test_balanced_step_on_four_ranks_equals_unbalanced_and_publishes_its_sharded_weights():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT, root], capture_output=True, text=True, timeout=600, env=env)
    assert "BALANCE_OK" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-4000:]
