"""The CPU plugin: everything that exists only because the model runs on XLA:CPU.

- ``native/``: C++ kernels built with the host's compiler on first use and called through
  ``jax.ffi`` (paged decode attention, weight products of few rows, the sampling argmax);
- ``kernels.py``: registers them (and the CPU form of the portable ``live_pages`` attention) with
  the kernel seam (``laminar_jax/kernels.py``) when a caller asks for the ``cpu`` platform's
  kernels; nothing in ``model/``, ``learner/`` or the rollout core imports this package;
- ``threads.py``: XLA:CPU's intra-op pool size and async dispatch (``runtime.cpu_threads``);
- ``host_malloc.py``: the C allocator's policy (``runtime.host_malloc``).

The entry points apply the process knobs through ``laminar_jax/process_settings.py``.
"""
