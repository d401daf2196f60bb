"""Connections between processes: length-prefixed frames over TCP (`wire.py`) and the run's keys
(`auth.py`: the link key that authenticates every frame, the learner's signing key).

The relay tier and the rollout servers' sequence transfer both speak it; it imports no plane.
"""
