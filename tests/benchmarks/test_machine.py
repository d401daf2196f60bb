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
vendor_id\t: AuthenticAMD
cpu family\t: 26
model\t\t: 2
model name\t: AMD EPYC
stepping\t: 1
cache size\t: 1024 KB
flags\t\t: fpu sse2 avx2 fma

processor\t: 1
cpu family\t: 25
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
    assert summary_line(info).startswith(f"machine: AMD EPYC (family 26 model 2), {info['cores']} cores, avx2 fma")


def test_describe_names_the_cpu_generation_and_caches(tmp_path):
    # "AMD EPYC" alone covers Zen 3 to Zen 5; family/model and the cache sizes tell them apart.
    path = tmp_path / "cpuinfo"
    path.write_text(_AVX2_CPUINFO)
    caches = tmp_path / "cache"
    for index, (level, kind, size) in enumerate([(1, "Data", "48K"), (1, "Instruction", "32K"), (2, "Unified", "1024K"),
                                                 (3, "Unified", "32768K")]):
        d = caches / f"index{index}"
        d.mkdir(parents=True)
        (d / "level").write_text(f"{level}\n")
        (d / "type").write_text(f"{kind}\n")
        (d / "size").write_text(f"{size}\n")
    (caches / "uevent").write_text("")  # not a cache index: skipped
    info = describe(str(path), str(caches))
    assert info["id"] == {"vendor": "AuthenticAMD", "family": "26", "model": "2", "stepping": "1"}
    assert info["caches"] == {"L1d": "48K", "L1i": "32K", "L2": "1024K", "L3": "32768K"}
    line = summary_line(info)
    assert line.startswith("machine: AMD EPYC (family 26 model 2), ")
    assert "L2 1024K, L3 32768K" in line


def test_describe_without_cpuinfo_still_names_something(tmp_path):
    info = describe(str(tmp_path / "missing"), str(tmp_path / "no-caches"))
    assert isinstance(info["cpu"], str) and info["isa"] == [] and info["id"] == {} and info["caches"] == {}
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
