"""optrace: time per XLA op from a jax.profiler trace. On the CPU a real trace of a real program
(its ops are XLA:CPU's op events); the device side on made-up traces in the layout of JAX's GPU
traces (an H100's were read in a lease; no GPU in CI), which must count each op once, not again
as part of its module's span."""

import gzip
import json

import jax
import jax.numpy as jnp
import pytest

from laminar_jax.benchmarks import learner as learner_bench
from laminar_jax.benchmarks import optrace


def _fake_trace(path, lines: dict, events: list) -> str:
    """A made-up Perfetto trace: one /device:GPU:0 process (pid 1) with the named lines (tid -> name),
    one host process (pid 2), and the given complete events."""
    meta = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/host:CPU"}}]
    meta += [{"ph": "M", "pid": 1, "tid": tid, "name": "thread_name", "args": {"name": n}} for tid, n in lines.items()]
    file = str(path / "fake.trace.json.gz")
    with gzip.open(file, "wt") as f:
        json.dump({"traceEvents": meta + events}, f)
    return file


def _x(pid, tid, name, dur, **args):
    return {"ph": "X", "pid": pid, "tid": tid, "name": name, "ts": 0, "dur": dur, "args": args}


def test_fake_device_trace_counts_the_xla_ops_line_once_per_op(tmp_path):
    events = [_x(1, 10, "jit_step", 1000),  # the module's span: the same time again
              _x(1, 11, "fusion.3", 300, hlo_op="fusion.3"), _x(1, 11, "fusion.12", 100, hlo_op="fusion.12"),
              _x(1, 11, "gemm", 500, hlo_op="custom-call.7"),
              _x(1, 12, "sm90_xmma_gemm_kernel", 500),  # the kernel behind custom-call.7, on its stream
              _x(2, 5, "host_fusion", 999, hlo_op="host_fusion.1")]
    path = _fake_trace(tmp_path, {10: "XLA Modules", 11: "XLA Ops", 12: "Stream #7(Compute)"}, events)
    t = optrace.op_table(path, calls=2)
    assert t["where"] == "device" and t["op_ms"] == pytest.approx(0.45)
    rows = {r["op"]: r for r in t["ops"]}
    assert set(rows) == {"fusion", "custom-call"}
    assert rows["fusion"]["count"] == 1.0 and rows["fusion"]["ms"] == pytest.approx(0.2)
    assert abs(sum(r["share"] for r in t["ops"]) - 1.0) < 1e-9


def test_fake_device_trace_without_an_ops_line_reads_its_streams_but_not_module_spans(tmp_path):
    events = [_x(1, 10, "jit_step", 1000), _x(1, 12, "loop_fusion_3", 250), _x(1, 13, "loop_fusion_4", 250)]
    path = _fake_trace(tmp_path, {10: "XLA Modules", 12: "Stream #7", 13: "Stream #8"}, events)
    t = optrace.op_table(path)
    assert t["where"] == "device" and t["op_ms"] == pytest.approx(0.5)
    assert [(r["op"], r["count"]) for r in t["ops"]] == [("loop_fusion", 2.0)]


def test_a_device_trace_mostly_in_command_buffers_says_their_ops_are_hidden(tmp_path, capsys):
    # As an H100 traced a learner step: 3,353 ops inside CUDA graphs, a few outside them.
    events = [_x(1, 11, "command_buffer.3", 990, hlo_op="command_buffer.3"),
              _x(1, 11, "input_reduce_fusion.1", 10, hlo_op="input_reduce_fusion.1")]
    path = _fake_trace(tmp_path, {11: "XLA Ops"}, events)
    t = optrace.op_table(path)
    assert "xla_gpu_enable_command_buffer" in t["note"]
    optrace.print_table(t, "step")
    assert "note: most op time is inside command buffers" in capsys.readouterr().out
    events[0]["dur"] = 5  # a few graphs among many plain ops: no note
    assert "note" not in optrace.op_table(_fake_trace(tmp_path, {11: "XLA Ops"}, events))


def test_a_real_cpu_trace_names_the_programs_ops(tmp_path):
    x = jnp.ones((64, 64))
    f = jax.jit(lambda a: jnp.tanh(a @ a.T).sum(axis=0) + jnp.cumsum(a, axis=1)[:, -1])
    path = optrace.capture(lambda: f(x), str(tmp_path / "trace"), calls=3)
    t = optrace.op_table(path, calls=3, top=50)
    assert t["where"] == "host" and t["op_ms"] > 0 and t["ops"]
    assert all("." not in r["op"] or not r["op"].rsplit(".", 1)[1].isdigit() for r in t["ops"])
    assert abs(sum(r["ms"] for r in t["ops"]) - t["op_ms"]) < 1e-6  # every op row shown (top=50)


def test_learner_bench_traces_an_unpublished_step(tmp_path, capsys):
    out = learner_bench.main(["--quick", "--preset", "tiny", "--batch", "2", "--seq", "32", "--steps", "1",
                              "--no-publish", "--trace", str(tmp_path / "ltrace")])
    assert out["published"] is False and out["publish_wait_s"] == 0.0
    assert out["ops_per_step"]["where"] == "host" and out["ops_per_step"]["op_ms"] > 0
    assert "one learner step, traced" in capsys.readouterr().out


def test_engine_decode_profile_traces_its_step(tmp_path):
    from flax import nnx

    from laminar_jax.benchmarks import engine_profile as engine_bench
    from laminar_jax.model import PRESETS, Transformer

    model = Transformer(PRESETS["tiny"], rngs=nnx.Rngs(0), dtype=jnp.float32, param_dtype=jnp.float32)
    r = engine_bench.profile_decode(model, rows=4, context=16, iters=1, trace_dir=str(tmp_path / "etrace"))
    assert r["step_ms"] > 0 and r["ops"]["where"] == "host"
    # The step's products: XLA's dots (ynn fusions), or the native kernels' FFI calls on CPU (rollout.weight_products).
    assert any(row["op"].startswith(("ynn_fusion", "ffi_call")) or "dot" in row["op"] for row in r["ops"]["ops"])
