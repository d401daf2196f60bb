"""Cluster simulator and placement planner (discrete-event model running the project's policies).

Public API:
  SimSection, finalize_sim       -- the simulator's config section
  simulate(cfg) -> SimResult     -- one run
  CostModel, CostParams          -- roofline cost model and its efficiency parameters
  GPUS, model_shape              -- hardware presets and model shapes
  plan(...)                      -- placement search (laminar_jax.sim.planner)
"""

from laminar_jax.sim.api import cost_model, placement, simulate
from laminar_jax.sim.config import SIM_MODES, SimSection, default_sim_config, finalize_sim
from laminar_jax.sim.cost import CostModel, CostParams
from laminar_jax.sim.hardware import GPUS, GpuSpec, ModelShape, gpu_spec, model_shape
from laminar_jax.sim.metrics import SimResult

__all__ = ["simulate", "cost_model", "placement", "SIM_MODES", "SimSection", "default_sim_config", "finalize_sim",
           "CostModel", "CostParams", "GPUS", "GpuSpec", "ModelShape", "gpu_spec", "model_shape", "SimResult"]
