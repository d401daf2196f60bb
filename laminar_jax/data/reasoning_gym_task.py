"""reasoning-gym datasets as prompt rows, scored by each dataset's own ``score_answer``."""

from __future__ import annotations

import json
import re
from typing import Any, Optional

PREFIX = "reasoning_gym/"
INSTRUCTION = "\n\nGive only the final answer inside <answer></answer> tags."

# Held-out prompts (data.val_size) are the same dataset generated under another seed. A small
# problem space may still repeat a training problem by chance; data.val_files avoids that.
_VAL_SEED_OFFSET = 0x5A11


def val_seed(seed: int) -> int:
    """The seed of a reasoning-gym dataset's held-out prompts (never the training seed)."""
    return (seed + _VAL_SEED_OFFSET) % 2**32


_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)


def extract_answer(response: str) -> Optional[str]:
    """The last ``<answer>...</answer>``; else the last ``\\boxed{...}``; else the last non-empty line."""
    tags = _ANSWER_TAG.findall(response)
    if tags:
        return tags[-1].strip()
    boxed = _last_boxed(response)
    if boxed is not None:
        return boxed.strip()
    lines = [ln.strip() for ln in response.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else None


def _last_boxed(text: str) -> Optional[str]:
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i, depth = start + len("\\boxed{"), 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def _json_roundtrip(entry: dict) -> dict:
    # Tuples become lists etc.: the scorer sees exactly what a worker process will receive.
    return json.loads(json.dumps(entry, default=str))


class ReasoningGymRows:
    """Random access to ``create_dataset(name, size, seed)`` as verl-layout rows."""

    def __init__(self, name: str, size: int, seed: int):
        import reasoning_gym

        self.name, self.size, self.seed = name, size, seed
        try:
            self._ds = reasoning_gym.create_dataset(name, size=size, seed=seed)
        except Exception as e:  # unknown names raise ValueError/KeyError deep inside
            raise ValueError(f"data.reasoning_gym_dataset={name!r}: cannot create it ({e})") from e

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[str, dict]:
        entry = _json_roundtrip(self._ds[int(index)])
        row = {
            "data_source": PREFIX + self.name,
            "prompt": [{"role": "user", "content": entry["question"] + INSTRUCTION}],
            "reward_model": {"ground_truth": entry["answer"], "style": "rule"},
            "extra_info": {"rg_dataset": self.name, "rg_size": self.size, "rg_seed": self.seed, "rg_entry": entry},
        }
        return f"reasoning_gym:{self.name} row {index}", row


class ReasoningGymScorer:
    """Reward fn for ``reasoning_gym/<name>`` rows; caches one dataset object per (name, size, seed)."""

    def __init__(self):
        self._datasets: dict[tuple, Any] = {}

    def _dataset(self, name: str, size: int, seed: int):
        key = (name, size, seed)
        if key not in self._datasets:
            import reasoning_gym

            self._datasets[key] = reasoning_gym.create_dataset(name, size=size, seed=seed)
        return self._datasets[key]

    def __call__(self, response: str, ground_truth: Any, extra_info: Any) -> float:
        info = extra_info or {}
        entry = info.get("rg_entry")
        name = info.get("rg_dataset")
        if not isinstance(entry, dict) or not name:
            raise ValueError("reasoning_gym reward needs extra_info['rg_dataset'] and extra_info['rg_entry']")
        ds = self._dataset(name, int(info.get("rg_size", 1)), int(info.get("rg_seed", 0)))
        return float(ds.score_answer(extract_answer(response), entry))
