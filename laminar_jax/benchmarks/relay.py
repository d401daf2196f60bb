"""Relay-tier benchmark: learner stall, publish-to-visible latency, pull bandwidth, chain fan-out,
and the naive orbax save+restore alternative, measured side by side in one run.

    python -m laminar_jax.benchmarks.relay [--quick] [--sizes-mb 100,500,2000] [--link-mb-s 200]
    python -m laminar_jax.benchmarks.relay --auth-overhead [--chain-mb 64] [--reps 5]
    python -m laminar_jax.benchmarks.relay --lora [--rank 16]   (bytes per version, LoRA vs full: relay_lora.py)

``--auth-overhead`` measures only what the run key costs: the same relays with and without a
key, side by side, alternating versions (rate-limited 2-relay chain, unlimited 1-hop publish,
TCP and zero-copy pulls); medians, spread and auth/plain ratios.

The learner's stall is measured through the learner's own publish path (``HostCopy``).

Prints a table, then one JSON line (the returned dict) last.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any, Optional

import numpy as np

from laminar_jax.benchmarks.machine import emit
from laminar_jax.relay.chain import start_local_chain
from laminar_jax.relay.client import RelayClient
from laminar_jax.relay.config import RelaySection
from laminar_jax.relay.publisher import Publisher, chunk_bytes_for
from laminar_jax.relay.store import WeightStore

MB = 1 << 20


def _param_shapes(total_mb: int) -> list[tuple[str, tuple[int, ...], str]]:
    """LLM-like parameter set of about total_mb: bf16 embedding, f32 layer matrices, small vectors."""
    d = 1024
    embed_rows = max(1, total_mb * MB // 8 // (d * 2))  # ~1/8 of the bytes, bf16
    out = [("embed", (embed_rows, d), "bfloat16")]
    per_layer = 4 * d * d * 4 + 2 * d * 4  # one [d, 4d] f32 matrix + two norms
    for i in range(max(1, (total_mb * MB * 7 // 8) // per_layer)):
        out += [(f"l{i}.w", (d, 4 * d), "float32"), (f"l{i}.n1", (d,), "float32"), (f"l{i}.n2", (d,), "float32")]
    return out


def _make_params(total_mb: int, seed: int) -> dict:
    import jax
    import ml_dtypes

    rng = np.random.default_rng(seed)
    host = {}
    for name, shape, dt in _param_shapes(total_mb):
        a = rng.random(shape, dtype=np.float32)
        host[name] = a.astype(ml_dtypes.bfloat16) if dt == "bfloat16" else a
    tree = jax.device_put(host)
    jax.block_until_ready(tree)
    return tree


def _fresh(tree: dict) -> dict:
    """New device buffers with the same values (jax caches host copies on an array)."""
    import jax

    out = jax.tree.map(lambda a: a + 0, tree)
    jax.block_until_ready(out)
    return out


def _nbytes(tree: dict) -> int:
    return sum(int(a.nbytes) for a in tree.values())


def _timed(fn) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def _drop_cache(root: str) -> list[str]:
    files = []
    for d, _, names in os.walk(root):
        for n in names:
            p = os.path.join(d, n)
            fd = os.open(p, os.O_RDONLY)
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
            files.append(p)
    return files


def _raw_disk_read(files: list[str]) -> float:
    buf = memoryview(bytearray(64 * MB))
    n, t0 = 0, time.perf_counter()
    for p in files:
        with open(p, "rb", buffering=0) as f:
            while k := f.readinto(buf):
                n += k
    return n / (time.perf_counter() - t0)


def bench_stall(tree: dict, relay_addresses: list[str], cfg: RelaySection, reps: int) -> dict:
    """The learner's stall, measured the way ``Learner._start_publish`` incurs it, next to a plain
    ``jax.device_get`` of equally fresh buffers; interleaved, medians over ``reps``.

    Learner: ``HostCopy(version, flat, publisher)`` starts the device-to-host copies, a thread
    awaits them and then calls ``publisher.publish``; the learner blocks only in ``wait_copied()``
    (before its next donating step). Stall = construction + ``wait_copied``. Each publish is
    flushed before the next rep (relay only: the store's part is timed in ``bench_size``), which
    bounds host memory (on CPU the host copies are views that keep the device buffers alive).
    """
    import inspect
    from concurrent.futures import ThreadPoolExecutor

    import jax

    from laminar_jax.learner.publish import HostCopy

    stalls, d2hs = [], []
    with ThreadPoolExecutor(1, thread_name_prefix="publish") as worker, \
            Publisher(cfg, relay_addresses=relay_addresses) as pub:
        # A HostCopy that takes the learner's persistent publish worker gets it, as the learner would.
        kw = {"executor": worker} if "executor" in inspect.signature(HostCopy).parameters else {}
        for i in range(reps):
            fresh = _fresh(tree)
            dt, host = _timed(lambda: jax.device_get(fresh))
            d2hs.append(dt)
            del fresh, host
            fresh = _fresh(tree)
            t0 = time.perf_counter()
            hc = HostCopy(1000 + i, fresh, pub, **kw)
            hc.wait_copied(600)
            stalls.append(time.perf_counter() - t0)
            hc.wait_done(600)  # publish() returned (queued); not part of the learner's stall
            del fresh, hc
            pub.flush(600)
    med = statistics.median
    return {"stall_s": med(stalls), "d2h_s": med(d2hs), "stall_p90_s": _p90(stalls), "d2h_p90_s": _p90(d2hs),
            "stall_reps": reps}


def _p90(xs: list[float]) -> float:
    return sorted(xs)[min(len(xs) - 1, int(0.9 * len(xs)))]


def bench_size(total_mb: int, work: str, reps: int, stall_reps: int) -> dict:
    """Stall vs device_get, publish-to-visible, pull vs memcpy vs disk, orbax, for one size."""
    import jax

    tree = _make_params(total_mb, seed=total_mb)
    nbytes = _nbytes(tree)
    store = WeightStore(os.path.join(work, f"store{total_mb}"), keep_last=2)
    cfg = RelaySection(keep_in_memory=1, keep_last=2)
    calls, call_d2hs, store_vis, relay_vis, pulls, pull_copies, copies, prealloc = [], [], [], [], [], [], [], []
    with start_local_chain(1, cfg) as chain, Publisher(cfg, store, chain.addresses) as pub:
        client = RelayClient(chain.addresses, config=cfg)
        for v in range(1, reps + 1):
            fresh = _fresh(tree)
            dt, host = _timed(lambda: jax.device_get(fresh))
            call_d2hs.append(dt)
            del fresh, host
            fresh = _fresh(tree)
            calls.append(pub.publish(v, fresh))  # direct call with device arrays (the runtime's seed publish)
            del fresh
            pub.flush(600)
            t = pub.stats().timings[v]
            store_vis.append(t["store_visible"])
            relay_vis.append(t["relay_visible"])
            dt, (_, got) = _timed(lambda: client.pull(newer_than=v - 1, timeout=60))  # zero-copy map
            pulls.append(nbytes / dt)
            del got
            dt, (_, got) = _timed(lambda: client.pull(newer_than=v - 1, timeout=60, copy=True))
            pull_copies.append(nbytes / dt)
            dt, _ = _timed(lambda: {k: np.array(a) for k, a in got.items()})  # memcpy into fresh memory
            copies.append(nbytes / dt)
            dst = {k: np.ones_like(a) for k, a in got.items()}  # pre-touched: the best memcpy here
            dt, _ = _timed(lambda: [np.copyto(dst[k], a) for k, a in got.items()])
            prealloc.append(nbytes / dt)
            del got, dst
        m = store.manifest(reps)
        files = _drop_cache(os.path.join(work, f"store{total_mb}", m.data))
        disk = _raw_disk_read(files)
        _drop_cache(os.path.join(work, f"store{total_mb}", m.data))
        dt, _ = _timed(lambda: store.read(reps))
        store_read = nbytes / dt
        stall = bench_stall(tree, chain.addresses, cfg, stall_reps)
    naive_save, naive_restore = _orbax(tree, os.path.join(work, f"orbax{total_mb}"))
    med = statistics.median
    return {"mb": total_mb, "bytes": nbytes, "arrays": len(tree), **stall, "publish_call_s": med(calls),
            "publish_call_d2h_s": med(call_d2hs),
            "store_visible_s": med(store_vis), "relay_visible_s": med(relay_vis), "pull_gbps": med(pulls) / 1e9,
            "pull_copy_gbps": med(pull_copies) / 1e9, "raw_gbps": med(prealloc) / 1e9,
            "raw_fresh_gbps": med(copies) / 1e9, "disk_gbps": disk / 1e9,
            "store_read_gbps": store_read / 1e9, "naive_save_s": naive_save, "naive_restore_s": naive_restore,
            "naive_s": naive_save + naive_restore, "ours_s": med(relay_vis) + nbytes / med(pulls)}


def _orbax(tree: dict, path: str) -> tuple[float, float]:
    import jax
    import orbax.checkpoint as ocp

    shutil.rmtree(path, ignore_errors=True)
    ckpt = ocp.StandardCheckpointer()
    t_save, _ = _timed(lambda: (ckpt.save(path, tree), ckpt.wait_until_finished()))
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), tree)
    t_restore, restored = _timed(lambda: jax.block_until_ready(ckpt.restore(path, abstract)))
    ckpt.close()
    shutil.rmtree(path, ignore_errors=True)
    return t_save, t_restore


def bench_chain(total_mb: int, chunk_mb: Optional[float], link_rate: int, ns: list[int],
                versions: int) -> tuple[dict[int, float], dict[int, list[float]], int]:
    """Seconds from publish() until the last relay of an n-relay chain holds the version.

    Every link has the same token-bucket rate. Versions 1-2 warm the relays' buffers (steady
    state); the next ``versions`` are timed and the median is reported. The chunk size is the
    publisher's own choice for this link rate and version size (``chunk_bytes_for``) unless
    ``chunk_mb`` forces one. Returns (median per n, all timings per n, chunk bytes used).
    """
    flat = {k: np.asarray(v) for k, v in _host_params(total_mb).items()}
    cfg = RelaySection(link_rate_bytes_per_s=link_rate, link_burst_bytes=1 * MB, keep_in_memory=1,
                       io_timeout_s=120.0)
    if chunk_mb:
        c = int(chunk_mb * MB)
        cfg = dataclasses.replace(cfg, chunk_bytes=c, min_chunk_bytes=c)
    chunk = chunk_bytes_for(cfg, _nbytes(flat))
    med, every = {}, {}
    for n in ns:
        with start_local_chain(n, cfg) as chain, \
                Publisher(cfg, relay_addresses=chain.addresses, copy_numpy=False) as pub:
            last = RelayClient([chain.addresses[-1]], config=cfg)
            times = []
            for v in range(1, 3 + versions):
                t0 = time.perf_counter()
                pub.publish(v, flat)
                last.wait_for(v, timeout=600)
                if v > 2:
                    times.append(time.perf_counter() - t0)
        every[n], med[n] = times, statistics.median(times)
    return med, every, chunk


def bench_auth(total_mb: int, link_rate: int, reps: int) -> dict:
    """The run key's cost: keyed and keyless relays side by side, alternating which goes first."""
    from contextlib import ExitStack

    flat = {k: np.asarray(v) for k, v in _host_params(total_mb).items()}
    nbytes = _nbytes(flat)
    limited = RelaySection(link_rate_bytes_per_s=link_rate, link_burst_bytes=1 * MB, keep_in_memory=1,
                           io_timeout_s=120.0)
    free = RelaySection(keep_in_memory=1, io_timeout_s=120.0)
    tcp = dataclasses.replace(free, local_transport="tcp")
    from laminar_jax.net.auth import RunKeys

    keys = {"plain": None, "auth": RunKeys.generate()}
    figures = {m: {"chain2_s": [], "hop_s": [], "pull_tcp_gbps": [], "pull_map_gbps": []} for m in keys}
    with ExitStack() as stack:
        rigs = {}
        for mode, key in keys.items():
            chain = stack.enter_context(start_local_chain(2, limited, keys=key and key.for_hosts()))
            one = stack.enter_context(start_local_chain(1, free, keys=key and key.for_hosts()))
            rigs[mode] = (stack.enter_context(Publisher(limited, relay_addresses=chain.addresses,
                                                        copy_numpy=False, keys=key)),
                          RelayClient([chain.addresses[-1]], config=limited, keys=key and key.for_hosts()),
                          stack.enter_context(Publisher(free, relay_addresses=one.addresses, copy_numpy=False,
                                                        keys=key)),
                          RelayClient(one.addresses, config=tcp, keys=key and key.for_hosts()),
                          RelayClient(one.addresses, config=free, keys=key and key.for_hosts()))
        for rep in range(reps + 1):  # rep 0 warms every relay's buffers
            for mode in (("plain", "auth") if rep % 2 else ("auth", "plain")):
                pub2, last, pub1, ctcp, cmap = rigs[mode]
                v = rep + 1
                f = figures[mode]
                dt, _ = _timed(lambda: (pub2.publish(v, flat), last.wait_for(v, timeout=600)))
                f["chain2_s"].append(dt)
                dt, _ = _timed(lambda: (pub1.publish(v, flat), ctcp.wait_for(v, timeout=600)))
                f["hop_s"].append(dt)
                dt, _ = _timed(lambda: ctcp.pull(v - 1, timeout=60, copy=True))
                f["pull_tcp_gbps"].append(nbytes / dt / 1e9)
                dt, got = _timed(lambda: cmap.pull(v - 1, timeout=60, copy=True))
                f["pull_map_gbps"].append(nbytes / dt / 1e9)
                del got
                if rep == 0:
                    for xs in f.values():
                        xs.pop()
    med = statistics.median
    out = {"bench": "relay_auth", "bytes": nbytes, "reps": reps, "link_bytes_per_s": link_rate,
           "load_avg": list(os.getloadavg())}
    for name in figures["plain"]:
        a, b = figures["auth"][name], figures["plain"][name]
        out[name] = {"auth": med(a), "plain": med(b), "auth_vs_plain": med(a) / med(b),
                     "auth_range": [min(a), max(a)], "plain_range": [min(b), max(b)]}
    return out


def _process_cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def bench_polls(polls: int, reps: int) -> dict:
    """CPU per version poll (`RelayClient.latest_version`, what every rollout server does every
    ~50 ms), on one kept authenticated connection against a fresh connection per poll (the client
    closed after each poll, as before connections were kept). Client and relay threads are both in
    this process, so process CPU counts both sides. Modes alternate per repeat."""
    from laminar_jax.net.auth import RunKeys

    key = RunKeys.generate()
    cfg = RelaySection(io_timeout_s=60.0)
    figures: dict[str, list[float]] = {"kept": [], "fresh": []}
    with start_local_chain(1, cfg, keys=key.for_hosts()) as chain, \
            Publisher(cfg, relay_addresses=chain.addresses, keys=key) as pub:
        pub.publish(1, {"w": np.zeros(1024, np.float32)})
        pub.flush(60)
        client = RelayClient(chain.addresses, config=cfg, keys=key.for_hosts())
        for rep in range(reps + 1):  # rep 0 warms both paths
            for mode in (("kept", "fresh") if rep % 2 else ("fresh", "kept")):
                client.close()
                c0 = _process_cpu_s()
                for _ in range(polls):
                    if client.latest_version(timeout=10) != 1:
                        raise RuntimeError(f"poll: expected version 1, errors {client.errors}")
                    if mode == "fresh":
                        client.close()
                if rep:
                    figures[mode].append((_process_cpu_s() - c0) / polls * 1e3)
        client.close()
    med = statistics.median
    out = {"bench": "relay_polls", "polls_per_rep": polls, "reps": reps, "load_avg": list(os.getloadavg())}
    for mode, xs in figures.items():
        out[f"{mode}_cpu_ms_per_poll"] = med(xs)
        out[f"{mode}_range"] = [min(xs), max(xs)]
    kept = med(figures["kept"])  # os.times ticks at 10 ms: a short run can read 0
    out["fresh_vs_kept"] = med(figures["fresh"]) / kept if kept > 0 else None
    return out


def _host_params(total_mb: int) -> dict:
    rng = np.random.default_rng(1)
    return {name: rng.random(shape, dtype=np.float32) for name, shape, _ in _param_shapes(total_mb)}


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench relay", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smallest size only (< 2 min)")
    p.add_argument("--sizes-mb", default=None, help="comma-separated parameter-set sizes in MB")
    p.add_argument("--chain-mb", type=int, default=None, help="version size for the chain runs (MB)")
    p.add_argument("--chunk-mb", type=float, default=None,
                   help="force this chunk size on chain links (MB; default: the publisher's choice)")
    p.add_argument("--link-mb-s", type=float, default=200.0, help="token-bucket limit per link (MB/s)")
    p.add_argument("--reps", type=int, default=3, help="publish+pull repetitions per size")
    p.add_argument("--stall-reps", type=int, default=None,
                   help="interleaved stall / device_get pairs per size (default 15 quick, 9 full)")
    p.add_argument("--chain-versions", type=int, default=None,
                   help="timed versions per chain length after 2 warm-up ones (median; default 5 quick, 3 full)")
    p.add_argument("--workdir", default=None, help="scratch directory (default: a temp dir)")
    p.add_argument("--auth-overhead", action="store_true",
                   help="only the run key's cost: keyed vs keyless relays side by side (--chain-mb, --reps)")
    p.add_argument("--poll-cost", action="store_true",
                   help="only the CPU of a version poll: a kept connection vs a fresh one per poll (--reps)")
    return p.parse_args(argv)


def main(argv: list[str]) -> dict:
    if "--lora" in argv:  # publish bytes per version, LoRA adapters against the full model (relay_lora.py)
        from laminar_jax.benchmarks.relay_lora import main as lora_main

        return lora_main([a for a in argv if a != "--lora"])
    args = parse_args(argv)
    if args.poll_cost:
        print(f"load average before: {os.getloadavg()}", flush=True)
        result = bench_polls(200 if args.quick else 1000, args.reps)
        print(f"CPU-ms per version poll, medians of {args.reps}: kept connection "
              f"{result['kept_cpu_ms_per_poll']:.3f} ({result['kept_range'][0]:.3f}..{result['kept_range'][1]:.3f}), "
              f"fresh connection {result['fresh_cpu_ms_per_poll']:.3f} "
              f"({result['fresh_range'][0]:.3f}..{result['fresh_range'][1]:.3f}); "
              f"fresh / kept {result['fresh_vs_kept']}")
        print(f"load average after: {os.getloadavg()}")
        return emit(result)
    if args.auth_overhead:
        print(f"load average before: {os.getloadavg()}", flush=True)
        result = bench_auth(args.chain_mb or 64, int(args.link_mb_s * MB), args.reps)
        for k, v in result.items():
            if isinstance(v, dict):
                print(f"{k:14s} auth {v['auth']:.4g}  plain {v['plain']:.4g}  ratio {v['auth_vs_plain']:.3f}  "
                      f"(auth {v['auth_range'][0]:.4g}..{v['auth_range'][1]:.4g}, "
                      f"plain {v['plain_range'][0]:.4g}..{v['plain_range'][1]:.4g})")
        print(f"load average after: {os.getloadavg()}")
        return emit(result)
    sizes = [int(s) for s in args.sizes_mb.split(",")] if args.sizes_mb else ([100] if args.quick else [100, 500, 2000])
    chain_mb = args.chain_mb or (128 if args.quick else 512)
    chain_versions = args.chain_versions or (5 if args.quick else 3)
    link_rate = int(args.link_mb_s * MB)
    work = tempfile.mkdtemp(prefix="relay-bench-", dir=args.workdir)
    t_start = time.perf_counter()
    try:
        stall_reps = args.stall_reps or (15 if args.quick else 9)
        rows = [bench_size(s, work, args.reps, stall_reps) for s in sizes]
        chain, chain_all, chunk = bench_chain(chain_mb, args.chunk_mb, link_rate, [1, 2, 4, 8], chain_versions)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    _print_table(rows, chain, chain_mb, chunk, args.link_mb_s)
    big = rows[-1]
    result = {"bench": "relay", "bytes": big["bytes"], "stall_s": big["stall_s"], "d2h_s": big["d2h_s"],
              "stall_ratio": big["stall_s"] / max(big["d2h_s"], 1e-9), "stall_reps": big["stall_reps"],
              "stall_p90_s": big["stall_p90_s"], "d2h_p90_s": big["d2h_p90_s"],
              "publish_call_s": big["publish_call_s"], "pull_gbps": big["pull_gbps"],
              "raw_gbps": big["raw_gbps"], "pull_vs_raw": big["pull_gbps"] / big["raw_gbps"],
              "chain8_vs_1hop": chain[8] / chain[1],
              "chain8_vs_1hop_best": min(chain_all[8]) / min(chain_all[1]),
              "publish_call_ratio": big["publish_call_s"] / max(big["publish_call_d2h_s"], 1e-9),
              "naive_s": big["naive_s"], "ours_s": big["ours_s"],
              "store_visible_s": big["store_visible_s"], "relay_visible_s": big["relay_visible_s"],
              "disk_gbps": big["disk_gbps"], "raw_fresh_gbps": big["raw_fresh_gbps"],
              "pull_copy_gbps": big["pull_copy_gbps"],
              "pull_copy_vs_raw_fresh": big["pull_copy_gbps"] / big["raw_fresh_gbps"],
              "chain_s": {str(k): v for k, v in chain.items()},
              "chain_runs_s": {str(k): v for k, v in chain_all.items()}, "chain_bytes": chain_mb * MB,
              "chunk_bytes": chunk, "link_bytes_per_s": link_rate, "sizes": rows,
              "quick": args.quick, "load_avg": list(os.getloadavg()), "wall_s": time.perf_counter() - t_start}
    return emit(result)


def _print_table(rows: list[dict], chain: dict, chain_mb: int, chunk: int, link: float) -> None:
    print("GB/s columns: pull = zero-copy map of the local relay; pull cp = pull(copy=True); memcpy = into "
          "pre-touched memory; memcpy new = into fresh allocations; disk = cold raw read; ts = WeightStore.read")
    hdr = (f"{'size':>7} {'stall ms':>8} {'d2h ms':>7} {'ratio':>5} {'store vis':>9} {'relay vis':>9} "
           f"{'pull':>6} {'pull cp':>7} {'memcpy':>6} {'memcpy new':>10} {'disk':>5} {'ts':>5} "
           f"{'orbax s':>7} {'ours s':>6}")
    print(hdr)
    for r in rows:
        print(f"{r['bytes'] / MB:6.0f}M {r['stall_s'] * 1e3:8.2f} {r['d2h_s'] * 1e3:7.2f} "
              f"{r['stall_s'] / max(r['d2h_s'], 1e-9):5.2f} {r['store_visible_s']:9.2f} {r['relay_visible_s']:9.2f} "
              f"{r['pull_gbps']:6.2f} {r['pull_copy_gbps']:7.2f} {r['raw_gbps']:6.2f} {r['raw_fresh_gbps']:10.2f} "
              f"{r['disk_gbps']:5.2f} {r['store_read_gbps']:5.2f} {r['naive_s']:7.2f} {r['ours_s']:6.2f}")
    print("stall = the learner's (HostCopy + wait_copied); d2h = jax.device_get; medians of interleaved reps")
    print(f"chain: {chain_mb} MB version, {chunk / MB:.2f} MB chunks, {link:.0f} MB/s per link (median of timed versions)")
    for n, t in chain.items():
        print(f"  {n} relay(s): last relay has it after {t:6.2f} s  ({t / chain[1]:.2f}x one hop)")


if __name__ == "__main__":
    main(sys.argv[1:])
