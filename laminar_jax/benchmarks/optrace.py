"""Where a compiled program's time goes, op by op: a `jax.profiler` trace of a few calls, summed per
XLA op (`bench.py learner --trace DIR`, `bench.py engine --profile --trace DIR`).

The end-to-end figures say how far a step is from its roofline; this says which ops hold the time.
On a GPU the ops are the device's: the trace's `/device:` processes, from their "XLA Ops" line
when there is one (one event per HLO op), else every line but the module and step spans, which
would count the same time twice. On the CPU they are XLA:CPU's op events (those with an `hlo_op`),
which run on the calling thread or XLA's pool. Names are summed with their numeric suffixes
dropped (`fusion.12` and `fusion.3` are one row), since one row per instance would bury the
pattern in a step of hundreds of ops. The device reading follows the layout of JAX's GPU traces
(read on an H100 too: docs/BENCHMARKS.md, "Third lease"). There XLA runs most of a step's ops
inside command buffers (CUDA graphs), whose ops the trace does not show one by one: the table
then says so (`note`), and `XLA_FLAGS=--xla_gpu_enable_command_buffer=` shows them, at the price
of the launches the graphs save (a decode step of qwen2.5-0.5b at 64 rows: 3.1 against 6.1 ms).
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re
from typing import Any, Callable

_SUFFIX = re.compile(r"([._]\d+)+$")


def capture(fn: Callable[[], Any], trace_dir: str, calls: int = 3) -> str:
    """Run `fn` once untraced (compiles, caches), then `calls` times under a trace written to
    `trace_dir`; returns the Perfetto trace file's path."""
    import jax

    jax.block_until_ready(fn())
    os.makedirs(trace_dir, exist_ok=True)
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        for _ in range(calls):
            jax.block_until_ready(fn())
    found = sorted(glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True), key=os.path.getmtime)
    if not found:
        raise FileNotFoundError(f"{trace_dir}: jax.profiler wrote no *.trace.json.gz")
    return found[-1]


def op_name(event: dict) -> str:
    """The row an op event counts in: its HLO op (or kernel) name without numeric suffixes."""
    args = event.get("args") or {}
    return _SUFFIX.sub("", str(args.get("hlo_op") or event["name"]))


def op_table(trace_path: str, calls: int = 1, top: int = 15) -> dict:
    """Op time per call from a trace: {'where': 'device' | 'host', 'op_ms': all ops' time per call,
    'ops': [{'op', 'ms', 'count', 'share'}, ...] (the `top` largest by time)}. Device ops (a
    `/device:` process's events) are used when the trace has any, else the host's XLA op events."""
    with gzip.open(trace_path, "rt") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e]
    lines = _device_lines(events)
    if any((e["pid"], e.get("tid")) in lines for e in spans):
        where, ops = "device", [e for e in spans if (e["pid"], e.get("tid")) in lines]
    else:
        where, ops = "host", [e for e in spans if "hlo_op" in (e.get("args") or {})]
    time_us, count = collections.Counter(), collections.Counter()
    for e in ops:
        name = op_name(e)
        time_us[name] += float(e["dur"])
        count[name] += 1
    total = sum(time_us.values())
    rows = [{"op": name, "ms": us / calls / 1e3, "count": count[name] / calls, "share": us / total if total else 0.0}
            for name, us in time_us.most_common(top)]
    table = {"where": where, "op_ms": total / calls / 1e3, "ops": rows}
    if total and time_us["command_buffer"] >= 0.5 * total:
        table["note"] = ("most op time is inside command buffers (CUDA graphs), whose ops are not "
                         "traced one by one; XLA_FLAGS=--xla_gpu_enable_command_buffer= shows them "
                         "(and times the step without the graphs)")
    return table


def _device_lines(events: list) -> set:
    """(pid, tid) of the device lines whose events are ops: each `/device:` process's "XLA Ops"
    line if it has one, else its lines but module and step spans."""
    meta = [e for e in events if e.get("ph") == "M"]
    device = {e["pid"] for e in meta if e.get("name") == "process_name" and e["args"]["name"].startswith("/device:")}
    names = {(e["pid"], e.get("tid")): e["args"]["name"] for e in meta
             if e.get("name") == "thread_name" and e["pid"] in device}
    lines = set()
    for pid in device:
        mine = {k: v for k, v in names.items() if k[0] == pid}
        ops = {k for k, v in mine.items() if v == "XLA Ops"}
        lines |= ops or {k for k, v in mine.items() if "Modules" not in v and "Steps" not in v}
    return lines


def print_table(table: dict, title: str) -> None:
    # Summed over the threads (CPU) or streams (GPU) that ran them: more than the call's wall time
    # where ops overlap.
    print(f"{title}: {table['op_ms']:.2f} ms of {table['where']} op time per call, summed over threads/streams")
    print(f"  {'op':<48}{'ms/call':>9}{'ops/call':>9}{'share':>7}")
    for r in table["ops"]:
        print(f"  {r['op'][:48]:<48}{r['ms']:>9.3f}{r['count']:>9.1f}{r['share']:>7.1%}")
    if "note" in table:
        print(f"  note: {table['note']}")
