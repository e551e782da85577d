"""Tokenizer: a Hugging Face fast tokenizer plus its chat template."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tokenizers.decoders import DecodeStream

from tokenmill.engine.segment_cache import SegmentCache


def message_text(content: Any, index: int) -> str:
    """OpenAI message content: a string or a list of {"type": "text", "text": ...} parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(
                    part.get("text"), str):
                raise ValueError(f"messages[{index}].content: only text parts are supported")
            parts.append(part["text"])
        return "".join(parts)
    raise ValueError(f"messages[{index}].content: must be a string or a list of text parts")


class Tokenizer:
    def __init__(self, path: Path) -> None:
        from transformers import AutoTokenizer
        try:
            self.hf = AutoTokenizer.from_pretrained(str(path))
        except Exception as exc:
            raise ValueError(f"tokenizer: cannot load a tokenizer from {path}: {exc}") from exc
        self.backend = self.hf.backend_tokenizer
        self.eos_token_id: int | None = self.hf.eos_token_id
        self.vocab_size = len(self.hf)
        self.segments = SegmentCache.for_backend(self.backend)
        # with no ids to add, the post-processor leaves encode(text, True)'s ids as False's
        self.adds_no_ids = self.backend.num_special_tokens_to_add(False) == 0

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self.segments is not None and (self.adds_no_ids or not add_special_tokens):
            return self.segments.encode(text)
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def decode_stream(self, prefix_ids: list[int], skip_special_tokens: bool) -> DecodeStream:
        return DecodeStream(ids=prefix_ids, skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages: must be a non-empty list")
        clean = []
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or message.get("role") not in (
                    "system", "user", "assistant"):
                raise ValueError(f"messages[{i}].role: must be system, user or assistant")
            clean.append({"role": message["role"],
                          "content": message_text(message.get("content"), i)})
        if not self.hf.chat_template:
            raise ValueError("messages: this model has no chat template; send a prompt instead")
        return self.hf.apply_chat_template(clean, tokenize=False,
                                           add_generation_prompt=add_generation_prompt)
