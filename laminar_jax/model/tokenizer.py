"""Tokenizers: a built-in character tokenizer for CPU demos, and HF `tokenizer.json` via `tokenizers`.

Both satisfy the same small protocol used by data pipelines and the rollout engine:
``encode(text) -> list[int]``, ``decode(ids) -> str``,
``apply_chat_template(messages, tools=None, add_generation_prompt=True, chat_template=None, **flags) -> str``,
and the ids ``pad_id``, ``bos_id`` (or None), ``eos_id``, plus ``vocab_size``.

Chat messages are rendered through the model's own Jinja template (laminar_jax.model.chat_template);
the built-in tokenizer's template is BUILTIN_CHAT_TEMPLATE.
"""

from __future__ import annotations

import json
import os
from typing import Optional, Protocol, Sequence

from laminar_jax.model import chat_template as ct


class Tokenizer(Protocol):
    pad_id: int
    bos_id: Optional[int]
    eos_id: int
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def apply_chat_template(self, messages: Sequence[dict], *, tools=None, add_generation_prompt: bool = True,
                            chat_template: Optional[str] = None, **template_kwargs) -> str: ...


class BuiltinTokenizer:
    """Character tokenizer: ids 0..3 are <pad>, <bos>, <eos>, <unk>; then '\\n' and printable ASCII.

    vocab_size is 100; unknown characters map to <unk> and decode as '?'.
    """

    PAD, BOS, EOS, UNK = 0, 1, 2, 3
    _CHARS = "\n" + "".join(chr(c) for c in range(32, 127))

    def __init__(self):
        self.pad_id, self.bos_id, self.eos_id = self.PAD, self.BOS, self.EOS
        self._to_id = {c: i + 4 for i, c in enumerate(self._CHARS)}
        self.vocab_size = 4 + len(self._CHARS)

    def encode(self, text: str) -> list[int]:
        return [self._to_id.get(c, self.UNK) for c in text]

    def decode(self, ids: Sequence[int]) -> str:
        out = []
        for i in ids:
            i = int(i)
            if i in (self.PAD, self.BOS, self.EOS):
                continue
            out.append(self._CHARS[i - 4] if 4 <= i < self.vocab_size else "?")
        return "".join(out)

    # Special tokens as the exported tokenizer.json names them (laminar_jax.weights.export).
    SPECIAL_TOKENS = {"pad_token": "<pad>", "bos_token": "<bos>", "eos_token": "<eos>", "unk_token": "<unk>"}

    def apply_chat_template(self, messages: Sequence[dict], *, tools=None, add_generation_prompt: bool = True,
                            chat_template: Optional[str] = None, **template_kwargs) -> str:
        """BUILTIN_CHAT_TEMPLATE (or `chat_template`): a lone user message verbatim, else role lines."""
        return ct.render(chat_template or ct.BUILTIN_CHAT_TEMPLATE, messages, special_tokens=self.SPECIAL_TOKENS,
                         tools=tools, add_generation_prompt=add_generation_prompt, **template_kwargs)


    def save_pretrained(self, path: str) -> list[str]:
        """Write this tokenizer as tokenizer.json + tokenizer_config.json that transformers loads as is.

        One token per character (WordLevel over single-character splits, joined back by a Fuse
        decoder); the post-processor prepends <bos> when special tokens are added, as the data plane
        does (data.add_bos); the chat template is BUILTIN_CHAT_TEMPLATE after {{ bos_token }}, so
        transformers' apply_chat_template(tokenize=True) gives exactly the demo's prompt ids.
        """
        from tokenizers import Regex, Tokenizer as _Tok, decoders, models, pre_tokenizers, processors

        st = self.SPECIAL_TOKENS
        vocab = {st["pad_token"]: self.PAD, st["bos_token"]: self.BOS, st["eos_token"]: self.EOS,
                 st["unk_token"]: self.UNK, **self._to_id}
        tok = _Tok(models.WordLevel(vocab, unk_token=self.SPECIAL_TOKENS["unk_token"]))
        tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
        tok.decoder = decoders.Fuse()
        tok.add_special_tokens(list(self.SPECIAL_TOKENS.values()))
        bos = self.SPECIAL_TOKENS["bos_token"]
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A $B",
                                                           special_tokens=[(bos, self.BOS)])
        os.makedirs(path, exist_ok=True)
        files = [os.path.join(path, "tokenizer.json"), os.path.join(path, "tokenizer_config.json")]
        tok.save(files[0])
        config = {"tokenizer_class": "PreTrainedTokenizerFast", **self.SPECIAL_TOKENS, "add_bos_token": True,
                  "add_eos_token": False, "clean_up_tokenization_spaces": False,
                  "chat_template": "{{- bos_token }}" + ct.BUILTIN_CHAT_TEMPLATE}
        with open(files[1], "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2)
        return files


class HFTokenizer:
    """A Hugging Face `tokenizer.json` (+ optional tokenizer_config.json for special tokens and the chat template).

    The chat template is `chat_template.jinja` beside tokenizer.json, else tokenizer_config.json's
    `chat_template`; a tokenizer without one renders chat messages only with an explicit template.
    """

    def __init__(self, path: str):
        from tokenizers import Tokenizer as _Tok

        file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        if not os.path.exists(file):
            raise FileNotFoundError(f"tokenizer file not found: {file}")
        self._tok = _Tok.from_file(file)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        cfg = {}
        cfg_file = os.path.join(os.path.dirname(file), "tokenizer_config.json")
        if os.path.exists(cfg_file):
            with open(cfg_file) as f:
                cfg = json.load(f)

        def _id(name: str) -> Optional[int]:
            tok = cfg.get(name)
            if isinstance(tok, dict):
                tok = tok.get("content")
            return None if tok is None else self._tok.token_to_id(tok)

        # Templates read special tokens by name (e.g. Llama-3's {{ bos_token }}), as in transformers.
        self.special_tokens = {}
        for name in ct.SPECIAL_TOKEN_NAMES:
            tok = cfg.get(name)
            tok = tok.get("content") if isinstance(tok, dict) else tok
            if isinstance(tok, str):
                self.special_tokens[name] = tok
        self.templates = ct.TemplateSource(os.path.dirname(os.path.abspath(file)), cfg)
        self.eos_id = _id("eos_token")
        if self.eos_id is None:
            raise ValueError(f"{file}: no eos_token found (set it in tokenizer_config.json)")
        self.bos_id = _id("bos_token")
        pad = _id("pad_token")
        self.pad_id = self.eos_id if pad is None else pad

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def apply_chat_template(self, messages: Sequence[dict], *, tools=None, add_generation_prompt: bool = True,
                            chat_template: Optional[str] = None, **template_kwargs) -> str:
        """The model's template (or `chat_template`); MissingChatTemplateError naming the file if none."""
        source = chat_template or self.templates.template(with_tools=tools is not None)
        return ct.render(source, messages, special_tokens=self.special_tokens, tools=tools,
                         add_generation_prompt=add_generation_prompt, **template_kwargs)


def load_tokenizer(spec: str) -> Tokenizer:
    """'builtin' -> BuiltinTokenizer; otherwise a path to a HF model dir or tokenizer.json."""
    if spec == "builtin":
        return BuiltinTokenizer()
    return HFTokenizer(spec)
