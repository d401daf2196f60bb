"""Experience buffer: sample-level store with field readiness, group release, samplers, ledger."""

from laminar_jax.buffer.ledger import DuplicatePrompt, PromptLedger
from laminar_jax.buffer.policies import GroupMeta, Selection, select_fifo, staleness
from laminar_jax.buffer.store import BufferTimeout, ExperienceStore

__all__ = ["DuplicatePrompt", "PromptLedger", "GroupMeta", "Selection", "select_fifo", "staleness", "BufferTimeout",
           "ExperienceStore"]
