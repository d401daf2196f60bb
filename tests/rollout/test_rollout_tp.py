"""Tensor-parallel rollout engine (rollout/tp.py) on a fake 8-device CPU host, in subprocesses.

TP 2 and TP 4 against TP 1 on the same fp32 weights: greedy tokens equal, behaviour log-probs
within 1e-5 (only the all-reduce order differs), samples that share a prompt too; a live sequence moves TP 2 -> TP 4 -> TP 1 and
continues as if unmoved; a host weight copy lands sharded; a GQA width mismatch is an error naming both.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tp_worker.py")


def _worker(check: str, timeout: int = 300) -> dict:
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, WORKER, check], env=env, capture_output=True, text=True, timeout=timeout,
                       cwd=ROOT)
    assert p.returncode == 0, f"worker {check} failed (rc={p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-5000:]}"
    line = next(x for x in p.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def _same(got, ref, what):
    assert got[0] == ref[0], f"{what}: tokens differ\n{got[0]}\n{ref[0]}"
    np.testing.assert_allclose(got[1], ref[1], rtol=0, atol=1e-5, err_msg=what)


@pytest.mark.parametrize("check", ["parity", "parity_chunked",
                                   pytest.param("parity_dense", marks=pytest.mark.slow)])
def test_tp_matches_single_device(check):
    out = _worker(check)
    ref = out["results"]["1"]
    assert len(ref) == 9 and min(out["shared"].values()) >= 1  # a shared prompt's copies too
    for tp in ("2", "4"):
        for uid, r in ref.items():
            _same(out["results"][tp][uid], r, f"TP {tp} {uid}")
    lay = out["layouts"]
    # Weights, KV and every state array on the server's own devices; KV split on the KV-head axis (4 heads).
    for tp, devs, heads in (("1", [0], 4), ("2", [2, 3], 2), ("4", [4, 5, 6, 7], 1)):
        assert lay[tp]["params"] == lay[tp]["kv"] == lay[tp]["state"] == devs
        assert lay[tp]["kv_shard"][0][1] == heads  # K pool f[P, Hkv, D, page]


def test_sequence_moves_across_tp_widths():
    out = _worker("moves")
    assert out["moves"] == 2
    assert len(out["ref"][0]) == 30
    _same(out["moved"], out["ref"], "moved TP2 -> TP4 -> TP1")


def test_host_weights_land_sharded():
    out = _worker("host_pull")
    shards = out["shards"]
    split = [k for k, (shape, per_dev, devs) in shards.items() if per_dev[0] != shape]
    assert devs_all(shards) == {(2, 3)}
    # q/k/v/o, gate/up/down of both layers and the (tied) embedding are split in half; norms whole.
    assert len(split) == 2 * 7 + 1, sorted(shards)
    for k in split:
        shape, per_dev, _ = shards[k]
        assert len(per_dev) == 2 and sum(np.prod(s) for s in per_dev) == np.prod(shape), k
    _same(out["out"], out["ref"], "new weights at TP 2 vs TP 1")


def devs_all(shards):
    return {tuple(v[2]) for v in shards.values()}


def test_kv_heads_not_divisible_is_an_error_naming_both():
    err = _worker("gqa_error")["error"]
    assert err is not None and "TP width 4" in err and "num_kv_heads=2" in err


def test_megatron_layout_gathers_no_weights():
    """Each device keeps its weight shards: the decode program all-reduces activations (after o and
    down) and all-gathers only the vocabulary-split logits for sampling, never a weight."""
    out = _worker("collectives")
    ops = out["ops"]
    # Hidden-state all-reduces: after o and after down in every layer, and the vocab-split embedding lookup.
    hidden = f"f32[{out['slots']},1,{out['hidden']}]"
    assert sum(op == "all-reduce" and s.startswith(hidden) for s, op in ops) == 2 * out["layers"] + 1, ops
    gathers = [shape for shape, op in ops if op != "all-reduce"]
    assert gathers and all(s.startswith(f"f32[{out['slots']},{out['vocab']}]") for s in gathers), gathers
