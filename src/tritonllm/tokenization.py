"""Tokenizer loading and incremental detokenization for streamed output.

Decoding each new token alone loses the spaces that SentencePiece/BPE tokenizers attach to the
following token and splits multi-byte UTF-8 characters across tokens. Decoding a short window of
context and emitting only the new, complete text gets both right (the approach vLLM and TGI use).
"""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

REPLACEMENT_CHAR = "\ufffd"


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(str(path))


def encode_prompt(tokenizer: PreTrainedTokenizerBase, text: str, chat: bool = False) -> list[int]:
    """Token ids of `text`, or of a one-turn chat (user message, assistant to answer) when `chat`."""
    if chat:
        if not tokenizer.chat_template:
            raise ValueError("this tokenizer has no chat template")
        messages = [{"role": "user", "content": text}]
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))
    return tokenizer(text)["input_ids"]


class IncrementalDetokenizer:
    """Turns a stream of token ids into a stream of text pieces whose concatenation is the full text."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        skip_special_tokens: bool = True,
        context_ids: list[int] | None = None,
    ):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # Seeding with the prompt's tail lets the first token keep its leading space.
        self.ids: list[int] = list(context_ids or [])[-6:]
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, token_ids: list[int]) -> str:
        """Add tokens; return the text they complete (may be '' while a character is incomplete)."""
        self.ids.extend(token_ids)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) <= len(prefix) or full.endswith(REPLACEMENT_CHAR):
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        return full[len(prefix) :]

    def flush(self) -> str:
        """Whatever is still held back at the end (an incomplete character decodes as U+FFFD)."""
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return full[len(prefix) :]
