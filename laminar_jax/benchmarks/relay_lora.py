"""bench relay --lora: bytes per published version, LoRA adapters against the full model.

    python launch/bench.py relay --lora [--rank 16] [--versions 5]

Demo model (configs/demo.py:lora): real versions, full and adapter-only (model/lora_version.py),
published through a ``Publisher`` to a ``WeightStore`` and one relay worker, and pulled back from
the relay; the bytes are the store manifests' and the pulled arrays', with publish-to-relay-visible
and pull times (medians). 7B (configs/gpu_node.py: Qwen2.5-7B served in bfloat16) at ``--rank``
with every projection targeted: bytes from the model's shapes, as the memory plan counts them (no
weights are allocated). Goal: an adapter version is <= 2% of a full one at rank 16 on the 7B.

Prints a table, then one JSON line (the returned dict) last.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import numpy as np

from laminar_jax.benchmarks.machine import emit

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _targets(shapes: dict, targets) -> dict:
    """{'<module>.weight': shape} of the Linear weights whose module is targeted (model/lora.py's rule)."""
    return {n: s for n, s in shapes.items() if n.endswith(".weight") and n.split(".")[-2] in targets
            and len(s) == (3 if n.startswith("layers.") else 2)}


def adapter_bytes(shapes: dict, targets, rank: int) -> int:
    """Bytes of one adapter version: float32 A [(L,) r, in] and B [(L,) out, r] per targeted weight,
    plus the base identity (32 bytes) and the scale (4)."""
    total = 32 + 4
    for s in _targets(shapes, targets).values():
        lead = int(np.prod(s[:-2])) if len(s) > 2 else 1
        total += 4 * lead * rank * (s[-1] + s[-2])
    return total


def full_bytes(shapes: dict, itemsize: int) -> int:
    return sum(int(np.prod(s)) * itemsize for n, s in shapes.items() if not n.startswith("value_head"))


def plan_7b(rank: int) -> dict:
    """The 7B config's version bytes, full and LoRA, from its shapes (abstract model)."""
    import jax
    from flax import nnx

    from configs.gpu_node import get_config
    from laminar_jax.model.presets import PRESETS
    from laminar_jax.model.transformer import Transformer
    from laminar_jax.naming import path_name

    cfg = get_config()
    model = nnx.eval_shape(lambda: Transformer(PRESETS[cfg.model.preset], rngs=nnx.Rngs(0)))
    shapes = {path_name(p): tuple(x.shape) for p, x in jax.tree_util.tree_flatten_with_path(nnx.state(model))[0]}
    full = full_bytes(shapes, np.dtype(jax.numpy.dtype(cfg.rollout.dtype)).itemsize)
    lora = adapter_bytes(shapes, PROJECTIONS, rank)
    return {"model": cfg.model.preset, "served_dtype": str(cfg.rollout.dtype), "rank": rank,
            "full_bytes": full, "lora_bytes": lora, "ratio": lora / full}


def _demo_versions(rank: int, versions: int):
    """The demo model's base (flat, served dtype) and ``versions`` adapter versions of it."""
    from flax import nnx

    from configs.demo import get_config
    from laminar_jax.learner.publish import flatten_params
    from laminar_jax.model.lora_version import adapter_version, base_identity
    from laminar_jax.model.presets import PRESETS
    from laminar_jax.model.transformer import Transformer

    cfg = get_config("lora")
    lora = getattr(cfg.learner, "lora", None)
    targets = tuple(getattr(lora, "targets", PROJECTIONS))
    base = {k: np.array(v) for k, v in flatten_params(nnx.split(Transformer(PRESETS[cfg.model.preset],
                                                                            rngs=nnx.Rngs(0)))[1]).items()}
    base_id = base_identity(base)
    rng = np.random.default_rng(0)
    out = []
    for _ in range(versions):
        adapters = {}
        for name, s in _targets({k: v.shape for k, v in base.items()}, targets).items():
            stem = name[:-len(".weight")]
            adapters[stem + ".lora_a"] = rng.normal(size=s[:-2] + (rank, s[-1])).astype(np.float32)
            adapters[stem + ".lora_b"] = rng.normal(size=s[:-2] + (s[-2], rank)).astype(np.float32)
        out.append(adapter_version(adapters, base_id, 2.0))
    return cfg.model.preset, base, out


def _publish_pull(kind_versions: list, work: str) -> dict:
    """Publish each flat version to a store and one relay, pull it back from the relay; medians."""
    from laminar_jax.relay.chain import start_local_chain
    from laminar_jax.relay.client import RelayClient
    from laminar_jax.relay.config import RelaySection
    from laminar_jax.relay.publisher import Publisher
    from laminar_jax.relay.store import WeightStore

    cfg = RelaySection(keep_in_memory=2, io_timeout_s=120.0)
    store = WeightStore(os.path.join(work, "weights"), keep_last=2)
    visible, pulls, stored, pulled = [], [], [], []
    with start_local_chain(1, cfg) as chain, \
            Publisher(cfg, store=store, relay_addresses=chain.addresses, copy_numpy=False) as pub:
        client = RelayClient(chain.addresses, config=cfg)
        for v, flat in enumerate(kind_versions, start=1):
            t0 = time.perf_counter()
            pub.publish(v, flat)
            client.wait_for(v, timeout=120)
            visible.append(time.perf_counter() - t0)
            pub.flush(120)
            stored.append(store.manifest(v).total_bytes)
            t0 = time.perf_counter()
            got_v, got = client.pull(newer_than=v - 1, timeout=60)
            pulls.append(time.perf_counter() - t0)
            pulled.append(sum(int(a.nbytes) for a in got.values()))
            assert got_v == v
        client.close()
        published = pub.stats().bytes_per_version
    med = statistics.median
    return {"store_bytes": int(med(stored)), "pulled_bytes": int(med(pulled)), "publisher_bytes": published,
            "relay_visible_s": med(visible), "pull_s": med(pulls)}


def main(argv: list[str]) -> dict:
    p = argparse.ArgumentParser(prog="bench relay --lora", description=__doc__.splitlines()[0])
    p.add_argument("--rank", type=int, default=16, help="adapter rank (demo model and 7B plan)")
    p.add_argument("--versions", type=int, default=5, help="versions published per kind (medians)")
    p.add_argument("--workdir", default=None)
    args = p.parse_args(argv)
    t_start = time.perf_counter()
    preset, base, adapter_versions = _demo_versions(args.rank, args.versions)
    with tempfile.TemporaryDirectory(prefix="relay-lora-", dir=args.workdir) as work:
        full = _publish_pull([base] * args.versions, os.path.join(work, "full"))
        lora = _publish_pull(adapter_versions, os.path.join(work, "lora"))
    plan = plan_7b(args.rank)
    demo_ratio = lora["store_bytes"] / full["store_bytes"]
    print(f"{'model':<14} {'rank':>4} {'full bytes':>14} {'LoRA bytes':>12} {'ratio':>7}  (published bytes per version)")
    print(f"{preset:<14} {args.rank:>4} {full['store_bytes']:>14,} {lora['store_bytes']:>12,} {demo_ratio:>7.2%}"
          f"   relay visible {full['relay_visible_s'] * 1e3:.1f} -> {lora['relay_visible_s'] * 1e3:.1f} ms, "
          f"pull {full['pull_s'] * 1e3:.1f} -> {lora['pull_s'] * 1e3:.1f} ms")
    print(f"{plan['model']:<14} {args.rank:>4} {plan['full_bytes']:>14,} {plan['lora_bytes']:>12,} "
          f"{plan['ratio']:>7.2%}   (from shapes, served {plan['served_dtype']}; goal <= 2%)")
    return emit({"bench": "relay_lora", "rank": args.rank, "demo_model": preset,
                 "demo_full": full, "demo_lora": lora, "demo_ratio": demo_ratio,
                 "publish_bytes_per_version": lora["publisher_bytes"], "plan_7b": plan,
                 "goal_met": plan["ratio"] <= 0.02, "load_avg": list(os.getloadavg()),
                 "wall_s": time.perf_counter() - t_start})
