"""Tensor-parallel engine checks on a fake 8-device CPU host; prints one JSON line of results.

Run with XLA_FLAGS=--xla_force_host_platform_device_count=8 (tests/rollout/test_rollout_tp.py does).
Servers: TP 1 on device 0, TP 2 on devices 2-3, TP 4 on devices 4-7, one model (fp32, 4 KV heads).
"""

import dataclasses
import json
import sys

import jax
import numpy as np
from flax import nnx

from laminar_jax.model import PRESETS, Transformer
from laminar_jax.rollout import RolloutServer, SequenceState, make_engine
from laminar_jax.rollout.tp import tp_mesh
from tests.rollout.rollout_helpers import SECTION, request, run_until

CFG = dataclasses.replace(PRESETS["tiny"], num_kv_heads=4)  # divisible by TP 1, 2, 4
DEVICES = {1: [0], 2: [2, 3], 4: [4, 5, 6, 7]}


def _server(tp, section=SECTION, seed=0):
    model = Transformer(CFG, rngs=nnx.Rngs(seed))
    engine, params = make_engine(model, section, mesh=tp_mesh([jax.devices()[i] for i in DEVICES[tp]]))
    return RolloutServer(engine, params, 0)


def _run(server, reqs):
    for r in reqs:
        server.submit(r)
    out = run_until(server, len(reqs))
    return {u: (t.response_ids.tolist(), t.behaviour_logprobs.tolist()) for u, t in out.items()}


def _layout(server):
    """Devices of the weights and the KV pool, and each device's KV shard shape."""
    params_dev = sorted(d.id for leaf in jax.tree.leaves(server._params) for d in leaf.sharding.device_set)
    k0 = server._state.k_pages  # one K pool of every layer's pages
    return {"params": sorted(set(params_dev)), "kv": sorted(d.id for d in k0.sharding.device_set),
            "kv_shard": [list(s.data.shape) for s in k0.addressable_shards][:1],
            "state": sorted({d.id for x in jax.tree.leaves(server._state) for d in x.sharding.device_set})}


def parity(section):
    reqs = [request(i, max_new=16, prompt_len=3 + i, temperature=0.0) for i in range(5)]
    reqs += [request(10 + i, max_new=16, prompt_len=6, temperature=0.9, top_k=40) for i in range(2)]
    # Two more samples of the last prompt (a GRPO group): admitted by copying its KV pages on every width.
    reqs += [dataclasses.replace(reqs[-1], uid=f"p11/{j}", sample_index=j, seed=50 + j) for j in (1, 2)]
    res, layouts, shared = {}, {}, {}
    for tp in (1, 2, 4):
        s = _server(tp, section)
        res[tp] = _run(s, reqs)
        layouts[tp] = _layout(s)
        shared[tp] = s.stats().prompts_shared
    return {"results": {str(k): v for k, v in res.items()}, "layouts": {str(k): v for k, v in layouts.items()},
            "shared": {str(k): v for k, v in shared.items()}}


def moves():
    """A sampled sequence runs 6 steps at TP 2, moves to TP 4, 6 more steps, then to TP 1, to the end."""
    req = request(7, max_new=30, prompt_len=11, temperature=0.9, top_k=40)
    ref = _run(_server(1), [req])[req.uid]
    a, b, c = _server(2), _server(4), _server(1)
    for i in range(2):
        b.submit(request(30 + i, max_new=30))  # company, so the sequence lands in other slots and pages
    a.submit(req)
    for _ in range(6):
        assert a.step() == []
    slot = next(s for s, u in a.live_slots().items() if u == req.uid)
    seq = SequenceState.from_bytes(a.export_sequence(slot).to_bytes())
    b.import_sequence(seq)
    for _ in range(6):
        for t in b.step():
            assert t.uid != req.uid
    slot = next(s for s, u in b.live_slots().items() if u == req.uid)
    seq = SequenceState.from_bytes(b.export_sequence(slot).to_bytes())
    c.import_sequence(seq)
    got = run_until(c, 1)[req.uid]
    return {"ref": ref, "moved": (got.response_ids.tolist(), got.behaviour_logprobs.tolist()), "moves": seq.moves}


def host_pull():
    """New weights from a host (numpy) copy land in the TP 2 layout, each device holding only its shard."""
    s = _server(2)
    host = jax.tree.map(np.asarray, nnx.split(Transformer(CFG, rngs=nnx.Rngs(1)))[1])
    placed = s.engine.placement.place(host)
    shards = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(placed)[0]:
        name, devs = jax.tree_util.keystr(path), sorted(d.id for d in leaf.sharding.device_set)
        per_dev = [list(x.data.shape) for x in leaf.addressable_shards]
        if name.startswith("['layers']"):  # stacked (leading layer axis, never split): one entry per layer
            assert all(p[0] == leaf.shape[0] for p in per_dev), (name, per_dev)
            for i in range(leaf.shape[0]):
                shards[f"{name}[{i}]"] = [list(leaf.shape[1:]), [p[1:] for p in per_dev], devs]
        else:
            shards[name] = [list(leaf.shape), per_dev, devs]
    s.set_params(1, placed)
    req = request(3, max_new=8, temperature=0.0)
    out = _run(s, [req])[req.uid]
    ref_server = _server(1, seed=1)
    ref = _run(ref_server, [req])[req.uid]
    return {"shards": shards, "out": out, "ref": ref}


def collectives():
    """The collectives of the TP 2 generate program: all-reduces, and all-gathers only of [slots, vocab] logits."""
    import re

    s = _server(2)
    eng = s.engine
    leaves, progs, _ = eng.bound(s._params)
    rows, n = eng.page_book.rows()
    text = progs.generate.lower(leaves, s._state, rows, n, eng.page_book.live_bucket()).compile().as_text()
    found = re.findall(r"= (\S+) (all-reduce|all-gather|reduce-scatter|all-to-all)\(", text)
    return {"ops": [[shape, op] for shape, op in found], "slots": SECTION.num_slots, "vocab": CFG.vocab_size,
            "hidden": CFG.hidden_size, "layers": 1}  # the layers' scan: one layer body in the program, every layer runs it


def gqa_error():
    model = Transformer(PRESETS["tiny"], rngs=nnx.Rngs(0))  # 2 KV heads
    try:
        make_engine(model, SECTION, mesh=tp_mesh(jax.devices()[:4]))
    except ValueError as e:
        return str(e)
    return None


if __name__ == "__main__":
    assert jax.device_count() == 8, jax.device_count()
    what = sys.argv[1]
    if what == "parity":
        out = parity(SECTION)
    elif what == "parity_chunked":
        out = parity(dataclasses.replace(SECTION, decode_chunk=2, attention_impl="live_pages"))
    elif what == "parity_dense":
        out = parity(dataclasses.replace(SECTION, attention_impl="gather_dense"))
    elif what == "moves":
        out = moves()
    elif what == "host_pull":
        out = host_pull()
    elif what == "collectives":
        out = collectives()
    elif what == "gqa_error":
        out = {"error": gqa_error()}
    else:
        raise SystemExit(f"unknown check {what!r}")
    print("RESULT " + json.dumps(out))
