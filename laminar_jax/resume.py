"""Which config changes a resume may make: a pure comparison of the saved and the new config.

A resumed run continues a ledger (prompts dispatched, samples counted, the data iterator's
position, the checkpointed TrainState). Keys whose change would make that ledger mean something
else are refused; every other change is returned to be logged.

    errors, changes = compare_resume_config(saved_dict, new_dict)

Both arguments are plain config dicts (``config.json`` of the run directory, and the new
config's dict). ``errors`` and ``changes`` are human-readable lines naming the dotted key.
"""

from __future__ import annotations

from typing import Any, Mapping

# dotted key -> why it cannot change on resume
REFUSED: dict[str, str] = {
    "seed": "sampling seeds of dispatched prompts derive from it",
    "runtime.samples_per_prompt": "the ledger's groups were dispatched with the old group size",
    "runtime.prompts_per_step": "the ledger's steps were cut with the old batch size",
    "data.source": "the data iterator's position indexes the old dataset",
    "data.path": "the data iterator's position indexes the old files",
    "data.name": "prompt uids and the iterator state are keyed by the dataset name",
    "data.reasoning_gym_dataset": "the data iterator's position indexes the old dataset",
    "data.dataset_size": "the data iterator's position indexes the old dataset",
    "data.seed": "the shuffle order of the saved iterator position comes from it",
    "data.shuffle": "the saved iterator position refers to the old order",
    "data.skew_repeat_median": "it defines the synthetic rows",
    "data.skew_repeat_sigma": "it defines the synthetic rows",
    "data.skew_max_repeats": "it defines the synthetic rows",
    "data.skew_pattern_min": "it defines the synthetic rows",
    "data.skew_pattern_max": "it defines the synthetic rows",
    "model.path": "the checkpoint holds another model's weights",
    "model.preset": "the checkpoint holds another architecture's weights",
    "model.value_head": "the checkpoint's parameter tree differs",
    "model.param_dtype": "the checkpoint's parameters are stored in the old dtype",
    "model.tokenizer": "token ids in the buffer and ledger come from the old tokenizer",
    "model.seed": "the initial weights (and the frozen reference copy) derive from it",
    "learner.lora.rank": "the checkpoint holds adapters of the old rank (0: full fine-tuning, none)",
    "learner.lora.alpha": "the adapters were trained at the old scale alpha / rank",
    "learner.lora.targets": "the checkpoint holds adapters of the old modules",
}

# Keys that name where the run lives, not what it computes: never reported.
IGNORED = frozenset({"runtime.run_dir"})


def flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dict -> {dotted key: leaf value}."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _norm(v: Any) -> Any:
    return list(v) if isinstance(v, tuple) else v  # JSON round trips turn tuples into lists


def compare_resume_config(saved: Mapping[str, Any], new: Mapping[str, Any]) -> tuple[list[str], list[str]]:
    """(errors, changes): refused changes with the reason, and allowed changes to log."""
    a, b = flatten(saved), flatten(new)
    errors, changes = [], []
    for key in sorted(set(a) | set(b)):
        if key in IGNORED or key.startswith("realised_placement."):  # a record of devices, not a key
            continue
        old, new_v = _norm(a.get(key, "<absent>")), _norm(b.get(key, "<absent>"))
        if old == new_v:
            continue
        line = f"{key}: {old!r} -> {new_v!r}"
        if key in REFUSED:
            errors.append(f"{line} cannot change on resume ({REFUSED[key]}); start a new run_dir instead")
        else:
            changes.append(line)
    return errors, changes
