"""Experience buffer: sample-level store with field readiness, group release, samplers, ledger."""

from laminar_jax.buffer.ledger import DuplicatePrompt, PromptLedger
from laminar_jax.buffer.policies import GroupMeta, Selection, select_fifo, select_with_signal, staleness, zero_signal
from laminar_jax.buffer.store import BufferTimeout, ExperienceStore

__all__ = ["DuplicatePrompt", "PromptLedger", "GroupMeta", "Selection", "select_fifo", "select_with_signal", "staleness",
           "zero_signal", "BufferTimeout", "ExperienceStore"]
