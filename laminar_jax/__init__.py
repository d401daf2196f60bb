"""laminar_jax: asynchronous RL post-training of LLMs in JAX.

Planes (each a subpackage): model, learner, rollout, relay, buffer, scheduler, data, runtime, sim.
Learner, rollout and relay never import each other; the runtime wires them.
"""

__version__ = "0.1.0"
