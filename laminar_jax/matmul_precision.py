"""The precision of float32 matrix products in this process (runtime.matmul_precision).

XLA computes a float32 product at the backend's "default" precision unless told otherwise, and that
default is not float32 everywhere: NVIDIA GPUs from Ampere on round the operands to TF32 (10-bit
mantissa) and TPUs to one bfloat16 pass. That puts float32 training attentions well outside a float32
tolerance of their reference and breaks logit parity with transformers, where the CPU agrees to 1e-6.

'auto', the default, follows model.dtype. A float32 model gets float32 products ('highest'), as
PyTorch computes float32 unless TF32 is allowed. A bfloat16 model keeps the backend's default: its
float32 products are the attention's, whose operands are bfloat16 values upcast (exact in TF32) or
softmax weights, so full float32 there would cost speed for accuracy that the bfloat16 products
around it do not keep. The CPU has no faster rounding: its compiled programs are the same at every
setting (tests/test_matmul_precision.py).

Entry points and Ray actors apply it once, before anything is traced (`process_settings.py`): a
run's servers and learner trace on threads of their own, which a scoped setting would not reach.
Code that traces on its caller's thread only, the offline `rollout.LLM`, scopes it instead
(`scoped_matmul_precision`), leaving the rest of the user's process as it was.
"""

from __future__ import annotations

# JAX's names; 'high' is three bfloat16 passes on TPUs.
PRECISIONS = ("auto", "highest", "high", "default")
_FLAG = "jax_default_matmul_precision"


def resolve_matmul_precision(name: str, compute_dtype: str, field: str = "runtime.matmul_precision") -> str:
    """The setting `name` means for a model computing in `compute_dtype` ('float32', 'bfloat16', ...);
    an unknown name is a ValueError naming `field`."""
    if name not in PRECISIONS:
        raise ValueError(f"{field}={name!r}: must be one of {list(PRECISIONS)}")
    if name != "auto":
        return name
    return "highest" if str(compute_dtype) == "float32" else "default"


def _setting(resolved: str):
    return None if resolved == "default" else resolved


def apply_matmul_precision(name: str, compute_dtype: str) -> str:
    """Trace this process's later matrix products at `name` for a `compute_dtype` model; returns the
    setting applied (one of PRECISIONS but 'auto')."""
    import jax

    resolved = resolve_matmul_precision(name, compute_dtype)
    jax.config.update(_FLAG, _setting(resolved))
    return resolved


def scoped_matmul_precision(resolved: str):
    """A context manager: matrix products traced inside it, on this thread, at `resolved`."""
    import jax

    return jax.default_matmul_precision(_setting(resolved))


def matmul_precision() -> str:
    """This process's current setting, as runtime.matmul_precision names it (never 'auto')."""
    import jax

    return getattr(jax.config, _FLAG) or "default"
