"""A self-contained Hugging Face directory for a model: weights, config.json, generation_config.json
and the tokenizer files, so transformers, TRL or vLLM load it with nothing built by hand.

The built-in demo tokenizer is written as a tokenizer.json (BuiltinTokenizer.save_pretrained); an HF
tokenizer is copied from ``model.tokenizer`` (a directory, or a tokenizer.json file and the files
beside it), else from ``model.path``.
"""

from __future__ import annotations

import json
import os
import shutil

# Copied beside tokenizer.json when present: special tokens, chat template.
TOKENIZER_COMPANIONS = ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def write_hf_dir(model, model_section, out_dir: str) -> None:
    """Weights + config.json (save_pretrained), the tokenizer files, then generation_config.json."""
    from laminar_jax.model.hf import save_pretrained

    save_pretrained(model, out_dir)
    write_tokenizer_files(model_section, out_dir)
    write_generation_config(model, model_section, out_dir)


def _tokenizer_source(model_section) -> tuple[str, str]:
    """(tokenizer.json path, directory of its companion files) for an HF tokenizer."""
    spec = model_section.tokenizer
    if spec and os.path.isfile(spec):
        return spec, os.path.dirname(os.path.abspath(spec))
    directory = spec if spec and os.path.isdir(spec) else model_section.path
    if not directory or not os.path.isfile(os.path.join(directory, "tokenizer.json")):
        raise FileNotFoundError(
            f"model.tokenizer={spec!r} / model.path={model_section.path!r}: no tokenizer.json to export")
    return os.path.join(directory, "tokenizer.json"), directory


def write_tokenizer_files(model_section, out_dir: str) -> list[str]:
    """The demo's built-in tokenizer as tokenizer.json, or a copy of the HF tokenizer's files."""
    from laminar_jax.model.tokenizer import BuiltinTokenizer

    os.makedirs(out_dir, exist_ok=True)
    if model_section.tokenizer == "builtin":
        return BuiltinTokenizer().save_pretrained(out_dir)
    tok_json, directory = _tokenizer_source(model_section)
    written = [shutil.copyfile(tok_json, os.path.join(out_dir, "tokenizer.json"))]
    for name in TOKENIZER_COMPANIONS:
        src = os.path.join(directory, name)
        if os.path.isfile(src):
            written.append(shutil.copyfile(src, os.path.join(out_dir, name)))
    return written


def write_generation_config(model, model_section, out_dir: str) -> str:
    """The source model's generation_config.json when it has one, else the token ids the policy uses."""
    from laminar_jax.model.tokenizer import load_tokenizer

    path = os.path.join(out_dir, "generation_config.json")
    src = os.path.join(model_section.path, "generation_config.json") if model_section.path else ""
    if src and os.path.isfile(src):
        return shutil.copyfile(src, path)
    tok = load_tokenizer(out_dir)  # the files just written: the ids transformers will see
    eos = list(model.cfg.eos_token_id) or [tok.eos_id]
    gen = {"bos_token_id": model.cfg.bos_token_id if model.cfg.bos_token_id is not None else tok.bos_id,
           "eos_token_id": eos[0] if len(eos) == 1 else eos, "pad_token_id": tok.pad_id}
    with open(path, "w", encoding="utf-8") as f:
        json.dump(gen, f, indent=2)
    return path
