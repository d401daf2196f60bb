"""Monitoring: what a run shows and records about itself.

The metrics sink (`sink.py`: `Monitor`, `RunStats`; metrics.jsonl, the summary), the console
(`console.py`), the scalar loggers (`loggers.py`: TensorBoard, W&B), the slot timeline
(`timeline.py`) and CPU-time accounting (`profile.py`). It reads only the plain records the Driver
hands it; no plane imports it but the runtime, the simulator and the benchmarks.
"""
