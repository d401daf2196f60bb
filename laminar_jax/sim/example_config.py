"""Example simulator config for launch/plan.py --config=laminar_jax/sim/example_config.py.

get_config() returns the ConfigDict of laminar_jax.sim.SimSection; any field may be overridden.
"""

from laminar_jax.sim.config import default_sim_config


def get_config():
    cd = default_sim_config()
    cd.model = "qwen2.5-7b"
    cd.gpu = "h800"
    cd.gpus = 128
    cd.workload = "math"
    cd.duration_s = 1800.0
    cd.warmup_s = 300.0
    cd.min_steps = 3
    return cd
