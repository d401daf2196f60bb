"""Every bench's JSON line names the machine it ran on (laminar_jax/benchmarks/machine.py)."""

import json
import subprocess
import sys

from laminar_jax.benchmarks.machine import ISA_FEATURES, describe, emit, summary_line
from tests.subprocess_env import ROOT, child_env

_AVX512_CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz
flags\t\t: fpu sse2 avx2 fma avx512f avx512_vnni avx512_bf16 amx_bf16 amx_tile

processor\t: 1
model name\t: something else
flags\t\t: fpu
"""

_AVX2_CPUINFO = """processor\t: 0
model name\t: AMD EPYC
flags\t\t: fpu sse2 avx2 fma
"""


def test_describe_reads_the_first_processor_model_and_its_vector_isa(tmp_path):
    path = tmp_path / "cpuinfo"
    path.write_text(_AVX512_CPUINFO)
    info = describe(str(path))
    assert info["cpu"] == "Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz"
    assert info["isa"] == ["avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16"]
    assert info["cores"] >= 1 and len(info["load_avg"]) == 3
    path.write_text(_AVX2_CPUINFO)
    info = describe(str(path))
    assert info["cpu"] == "AMD EPYC" and info["isa"] == ["avx2", "fma"]
    assert summary_line(info).startswith("machine: AMD EPYC, ") and "avx2 fma" in summary_line(info)


def test_describe_without_cpuinfo_still_names_something(tmp_path):
    info = describe(str(tmp_path / "missing"))
    assert isinstance(info["cpu"], str) and info["isa"] == []
    assert "no AVX2" in summary_line(info)


def test_this_machine_is_described():
    info = describe()
    assert info["cpu"] and set(info["isa"]) <= set(ISA_FEATURES)


def test_emit_prints_one_json_line_with_the_machine(capsys):
    out = emit({"bench": "x", "figure": 1.5})
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert json.loads(line) == out
    assert out["figure"] == 1.5 and out["machine"]["cpu"] == describe()["cpu"]


def test_a_bench_prints_its_machine_first_and_in_its_json_line(tmp_path):
    # sim --quick with one model, GPU count and mode is the cheapest whole bench (no JAX work).
    proc = subprocess.run([sys.executable, "launch/bench.py", "sim", "--quick", "--models", "7b", "--gpus", "64",
                           "--modes", "sync", "--duration", "600", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600, env=child_env(), cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[0].startswith("machine: ")
    result = json.loads(lines[-1])
    assert result["machine"]["cpu"] == describe()["cpu"]
