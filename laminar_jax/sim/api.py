"""Build and run one simulation from a SimSection (placement defaults, calibration file)."""

from __future__ import annotations

import dataclasses
from typing import Optional

from laminar_jax.sim.config import SimSection
from laminar_jax.sim.cost import CostModel, CostParams
from laminar_jax.sim.engine import Placement, Simulator
from laminar_jax.sim.hardware import gpu_spec, model_shape
from laminar_jax.sim.metrics import SimResult
from laminar_jax.sim.workload import workload


def cost_params(cfg: SimSection, base: Optional[CostParams] = None) -> CostParams:
    """Defaults, overridden by cfg.calibration's fitted values when set."""
    params = base or CostParams()
    if cfg.calibration:
        from laminar_jax.sim.calibrate import load_calibration

        params = load_calibration(cfg.calibration, params)
    return params


def cost_model(cfg: SimSection, params: Optional[CostParams] = None, tp: Optional[int] = None) -> CostModel:
    """The cost model of cfg; rollout TP = tp, cfg.rollout_tp, or the smallest that fits."""
    cm = CostModel(model_shape(cfg.model), gpu_spec(cfg.gpu), params or cost_params(cfg), 1, cfg.page_tokens)
    return dataclasses.replace(cm, tp=tp or cfg.rollout_tp or cm.min_tp())


def placement(cfg: SimSection, cost: CostModel) -> Placement:
    """Learner GPUs (cfg or half the cluster, whole machines), the rest as servers of cost.tp GPUs."""
    node = cost.gpu.gpus_per_node
    if cfg.colocate:
        return Placement(cfg.gpus, cost.tp, cfg.gpus // cost.tp)
    lg = cfg.learner_gpus if cfg.learner_gpus is not None else max(node, (cfg.gpus // 2) // node * node)
    servers = (cfg.gpus - lg) // cost.tp
    if servers < 1:
        raise ValueError(f"sim: learner_gpus={lg} of gpus={cfg.gpus} leaves no rollout server of tp={cost.tp}")
    return Placement(lg, cost.tp, servers)


def simulate(cfg: SimSection, params: Optional[CostParams] = None, timeline_path: Optional[str] = None) -> SimResult:
    """Run cfg once; optionally render the slot-occupancy timeline PNG."""
    cfg.validate("sim")
    cost = cost_model(cfg, params)
    sim = Simulator(cfg, cost, workload(cfg.workload), placement(cfg, cost))
    res = sim.run()
    if timeline_path:
        sim.rec.render_timeline(timeline_path, f"{cfg.mode} {cfg.model} {cfg.gpus}x{cfg.gpu}")
    return res
