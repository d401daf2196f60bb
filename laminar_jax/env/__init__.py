"""The environment plane: multi-turn environments, their tools, and the pool that runs them.

Environment (base.py), EnvPool (pool.py), the registry (registry.py), the Hermes tool-call
format (tools.py) and the built-ins: calculator, python (sandbox.py), latency.
"""

from laminar_jax.env.base import Environment, MalformedStepError, StepResult, check_reset, check_step
from laminar_jax.env.pool import EnvCallResult, EnvPool, EnvStats
from laminar_jax.env.registry import make_env, register_env, registered, select_env
from laminar_jax.env.tools import (
    TOOL_CALL_END, TOOL_CALL_START, ToolCall, ToolCallError, parse_tool_calls, render_tool_message)

__all__ = ["Environment", "MalformedStepError", "StepResult", "check_reset", "check_step", "EnvCallResult", "EnvPool",
           "EnvStats", "make_env", "register_env", "registered", "select_env", "TOOL_CALL_END", "TOOL_CALL_START",
           "ToolCall", "ToolCallError", "parse_tool_calls", "render_tool_message"]
