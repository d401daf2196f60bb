"""Fit cost-model efficiencies from this project's benchmark JSON lines; save and load them.

  python -m laminar_jax.sim.calibrate --model qwen2.5-7b --gpu h100 --tp 1 --out cal.json bench_*.jsonl

Inputs are files of JSON lines (the last line each benchmark prints; other lines are ignored). Rows
are found anywhere inside a record (nested lists/dicts), by their keys:

  decode rows   {"batch" | "batch_size", "context" | "ctx" | "context_len" | "seq_len",
                 "decode_step_s" | "step_s"}  (optional "tp", "model", "gpu"/"device")
                 or the same with "roofline_fraction" (= roofline time / measured) instead of a time
                 -> least squares  measured = overhead + roofline / efficiency
                    gives decode_overhead_s and mem_efficiency = flops_efficiency = efficiency
                or the engine bench's record {"bench": "engine", "decode_step_s_b64", "decode_context"}
                (one row: batch 64 at that per-sequence context)
  learner rows  {"mfu": x}                               -> learner_mfu = median
                or, where the bench has no peak to divide by (CPU: "mfu" null), the learner bench's
                {"bench": "learner", "params", "tokens_per_s"} -> mfu = 6·params·tokens_per_s / peak of
                --gpu, and an e2e capture (laminar_jax.benchmarks.e2e_capture) -> the same from its sync run's
                learner step time and tokens per step (sync's learner runs alone)
  relay record  {"bench": "relay", "chain_s": {hops: s}, "chain_bytes", "chunk_bytes", "link_bytes_per_s"}
                -> relay_efficiency = (bytes / link) / chain_s[1],
                   relay_hop_latency_s = max(0, slope of chain_s over hops - chunk / link)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any, Iterator, Optional

import numpy as np

from laminar_jax.sim.cost import CostModel, CostParams
from laminar_jax.sim.hardware import gpu_spec, model_shape

_BATCH = ("batch", "batch_size")
_CTX = ("context", "ctx", "context_len", "seq_len")
_TIME = ("decode_step_s", "step_s")


def read_records(paths: list[str]) -> list[dict]:
    """Every JSON object line of the files (a line that is not JSON is skipped)."""
    out = []
    for path in paths:
        with open(path) as f:
            for n, line in enumerate(f, 1):
                line = line.strip()
                if not line.startswith("{"):
                    continue
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{n}: not a JSON line ({e})") from None
    return out


def _walk(x: Any) -> Iterator[dict]:
    if isinstance(x, dict):
        yield x
        for v in x.values():
            yield from _walk(v)
    elif isinstance(x, list):
        for v in x:
            yield from _walk(v)


def _first(d: dict, keys) -> Optional[float]:
    for k in keys:
        if isinstance(d.get(k), (int, float)):
            return float(d[k])
    return None


def _engine_row(rec: dict) -> Optional[dict]:
    """The engine bench's timed decode step as a decode row."""
    if rec.get("bench") == "engine" and isinstance(rec.get("decode_step_s_b64"), (int, float)):
        return {"batch": 64, "context": rec.get("decode_context", 0), "decode_step_s": rec["decode_step_s_b64"]}
    return None


def fit_decode(records: list[dict], cost: CostModel) -> dict:
    """decode_overhead_s and efficiency from decode rows (see module docstring); {} if none."""
    roof, meas = [], []
    for rec in records:
        extra = _engine_row(rec)
        for row in list(_walk(rec)) + ([extra] if extra else []):
            b, c = _first(row, _BATCH), _first(row, _CTX)
            if b is None or c is None:
                continue
            cm = dataclasses.replace(cost, tp=int(row.get("tp", cost.tp)))
            ctx_total = b * c  # rows give per-sequence context
            r = float(cm.decode_roofline_s(b, ctx_total))
            t = _first(row, _TIME)
            if t is None and isinstance(row.get("roofline_fraction"), (int, float)) and row["roofline_fraction"] > 0:
                t = r / float(row["roofline_fraction"])
            if t is not None and t > 0:
                roof.append(r)
                meas.append(t)
    if len(roof) < 2:
        return {}
    slope, icpt = np.polyfit(np.asarray(roof), np.asarray(meas), 1)
    eff = float(np.clip(1.0 / max(slope, 1e-9), 0.05, 1.0))
    return {"mem_efficiency": eff, "flops_efficiency": eff, "decode_overhead_s": float(max(icpt, 0.0)),
            "decode_rows": len(roof)}


def _mfu(params: float, tokens_per_s: float, cost: CostModel) -> float:
    return 6.0 * params * tokens_per_s / (cost.gpu.bf16_tflops * 1e12)


def fit_learner(records: list[dict], cost: Optional[CostModel] = None) -> dict:
    """learner_mfu = median of the records' MFU figures (see module docstring); {} if none."""
    mfus = [float(r["mfu"]) for rec in records for r in _walk(rec)
            if isinstance(r.get("mfu"), (int, float)) and 0 < r["mfu"] <= 1]
    if cost is not None:
        for rec in records:
            if rec.get("bench") == "learner" and rec.get("mfu") is None and rec.get("tokens_per_s"):
                mfus.append(_mfu(float(rec["params"]), float(rec["tokens_per_s"]), cost))
            sync = rec.get("modes", {}).get("sync") if rec.get("bench") == "e2e_capture" else None
            if sync:
                step_s = sync["learner_busy_frac"] * sync["rl_wall_s"] / sync["steps_this_run"]
                step_tokens = sync["train_tokens_per_s"] * sync["rl_wall_s"] / sync["steps_this_run"]
                mfus.append(_mfu(cost.model.params, step_tokens / step_s, cost))
    return {"learner_mfu": float(np.median(mfus)), "learner_rows": len(mfus)} if mfus else {}


def fit_relay(records: list[dict]) -> dict:
    for rec in records:
        if rec.get("bench") != "relay" or not isinstance(rec.get("chain_s"), dict):
            continue
        link = float(rec["link_bytes_per_s"])
        hops = sorted((int(k), float(v)) for k, v in rec["chain_s"].items())
        if not hops or link <= 0:
            continue
        one = dict(hops).get(1, hops[0][1])
        eff = float(np.clip(float(rec["chain_bytes"]) / link / one, 0.01, 1.0))
        out = {"relay_efficiency": eff}
        if len(hops) >= 2:
            slope = np.polyfit([h for h, _ in hops], [s for _, s in hops], 1)[0]
            out["relay_hop_latency_s"] = float(max(0.0, slope - float(rec["chunk_bytes"]) / link))
        return out
    return {}


def fit(paths: list[str], model: str, gpu: str, tp: int = 1) -> dict:
    """Fitted CostParams fields (only those the inputs inform) plus provenance."""
    records = read_records(paths)
    cost = CostModel(model_shape(model), gpu_spec(gpu), CostParams(), tp)
    fitted = {**fit_decode(records, cost), **fit_learner(records, cost), **fit_relay(records)}
    params = {k: v for k, v in fitted.items() if k in {f.name for f in dataclasses.fields(CostParams)}}
    return {"params": params, "counts": {k: v for k, v in fitted.items() if k.endswith("_rows")},
            "sources": list(paths), "model": model, "gpu": gpu, "tp": tp}


def save_calibration(cal: dict, path: str) -> str:
    with open(path, "w") as f:
        json.dump(cal, f, indent=2)
    return path


def load_calibration(path: str, base: Optional[CostParams] = None) -> CostParams:
    """base (default CostParams()) with the file's fitted params; unknown names are an error."""
    with open(path) as f:
        cal = json.load(f)
    params = cal.get("params")
    if not isinstance(params, dict):
        raise ValueError(f"{path}: calibration must hold a 'params' mapping")
    names = {f.name for f in dataclasses.fields(CostParams)}
    for k, v in params.items():
        if k not in names:
            raise ValueError(f"{path}: params.{k} is not a CostParams field ({sorted(names)})")
        if not isinstance(v, (int, float)) or v <= 0:
            raise ValueError(f"{path}: params.{k}={v!r} must be a positive number")
    return dataclasses.replace(base or CostParams(), **{k: float(v) for k, v in params.items()})


def main(argv: list[str]) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+")
    ap.add_argument("--model", default="qwen2.5-7b")
    ap.add_argument("--gpu", default="h100")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    cal = fit(args.files, args.model, args.gpu, args.tp)
    save_calibration(cal, args.out)
    print(json.dumps(cal))
    return cal


if __name__ == "__main__":
    main(sys.argv[1:])
