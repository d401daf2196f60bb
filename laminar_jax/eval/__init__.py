"""Evaluation plane: held-out prompts scored during training (on the rollout servers) or offline.

  metrics   pure figures of one round: greedy accuracy, pass@k (unbiased estimator), mean response
            length, truncation rate, per data_source and overall.
  rounds    an eval round's requests (greedy + n sampled per prompt) and the sink that collects
            their scored samples apart from the training buffer.
  schedule  when the Driver starts a round and what it does with the finished ones.
  offline   `launch/eval.py`: one round through the offline engine, for a run dir or an HF dir.
"""

from laminar_jax.eval.metrics import EvalSample, pass_at_k, round_metrics

__all__ = ["EvalSample", "pass_at_k", "round_metrics"]
