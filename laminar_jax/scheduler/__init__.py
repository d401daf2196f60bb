"""Scheduler plane: pure repack policy (shared with the simulator) and, later, its executor."""

from laminar_jax.scheduler.repack import Move, RepackParams, ServerView, is_source, plan_repack

__all__ = ["Move", "RepackParams", "ServerView", "is_source", "plan_repack"]
