"""Learner plane: advantage estimators, PPO-family losses, the sharded train step, and its shell.

Public API:
  LearnerSection, MeshSection                  -- config sections
  ADVANTAGE_ESTIMATORS, compute_advantages     -- 'gae' | 'grpo' | 'rloo'
  TrainBatch, collate                          -- host-side batching of Trajectory records
  TrainState, make_train_step, make_prepare_fn -- the pure step
  build_mesh, param_shardings                  -- mesh ('data', 'fsdp', 'tensor') and logical rules
  Learner, SkippedUpdatesError                 -- the stateful shell
  Publisher, LocalPublisher                    -- weight publishing hook
  run_learner                                  -- minimal loop
"""

from laminar_jax.learner.advantages import ADVANTAGE_ESTIMATORS, compute_advantages
from laminar_jax.learner.batch import TrainBatch, collate
from laminar_jax.learner.config import LearnerSection, MeshSection
from laminar_jax.learner.learner import Learner, SkippedUpdatesError
from laminar_jax.learner.loop import run_learner
from laminar_jax.learner.mesh import build_mesh, param_shardings
from laminar_jax.learner.publish import LocalPublisher, Publisher
from laminar_jax.learner.step import TrainState, make_prepare_fn, make_train_step

__all__ = [
    "ADVANTAGE_ESTIMATORS", "compute_advantages", "TrainBatch", "collate", "LearnerSection", "MeshSection",
    "Learner", "SkippedUpdatesError", "run_learner", "build_mesh", "param_shardings", "LocalPublisher",
    "Publisher", "TrainState", "make_prepare_fn", "make_train_step",
]
