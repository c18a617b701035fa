"""Tokenizers prewarm runs prompts through: bytes for the reference engine, a Hugging Face
tokenizer (with its chat template) otherwise; ``tokenize`` turns a ``Prompt`` into token ids."""
from __future__ import annotations

from typing import Any, Protocol

from gdskv.cli._common import UsageProblem
from gdskv.cli.prewarm.prompts import Prompt


class Tokenizer(Protocol):
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def render_chat(self, messages: list[dict[str, Any]]) -> list[int]: ...


class ByteTokenizer:
    """Deterministic tokenizer for the reference engine without a Hugging Face tokenizer: one
    token per UTF-8 byte (ids 0..255). Chat messages are rendered as ``<|role|>\\ncontent\\n`` for
    each message, then ``<|assistant|>\\n``, and encoded the same way."""

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def render_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        text = "".join(f"<|{m.get('role', 'user')}|>\n{m['content']}\n" for m in messages) + "<|assistant|>\n"
        return self.encode(text)


class HfTokenizer:
    """A Hugging Face tokenizer with its chat template: one ``load``ed by name (``--tokenizer`` for
    the reference engine, chat prompts for MAX), or TensorRT-LLM's ``LLM.tokenizer`` wrapped."""

    def __init__(self, tok: Any) -> None:
        self.tok = tok

    @classmethod
    def load(cls, name: str) -> "HfTokenizer":
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise UsageProblem("--tokenizer needs the transformers package (pip install transformers)") from None
        try:
            return cls(AutoTokenizer.from_pretrained(name))
        except (OSError, ValueError) as e:  # not found, no network, not a tokenizer
            raise UsageProblem(f"--tokenizer {name}: {' '.join(str(e).split())}") from None

    @property
    def vocab_size(self) -> int:
        return len(self.tok)

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text))

    def render_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        return list(self.tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True))

    def render_chat_text(self, messages: list[dict[str, Any]]) -> str:
        return str(self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))


def tokenize(tok: Tokenizer, p: Prompt, max_tokens: int) -> list[int]:
    """The prompt's token ids; ValueError (the prompt is skipped) when it is unreadable, empty or
    longer than ``max_tokens``. Called by the reference, TensorRT-LLM and vLLM runners."""
    if p.error:
        raise ValueError(p.error)
    ids = tok.render_chat(p.messages) if p.messages is not None else tok.encode(p.text or "")
    if not ids or (p.messages is None and not (p.text or "").strip()):
        raise ValueError("empty prompt")
    if len(ids) > max_tokens:
        raise ValueError(f"too long: {len(ids)} tokens > --max-prompt-tokens {max_tokens}")
    return ids
