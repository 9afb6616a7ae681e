"""Text in and out: prompt tokenization, stop words, and stateless incremental detokenization.

`postprocessing` runs once per streamed response and keeps no state between calls, so the engine
model sends each response's new tokens together with a few tokens that precede them
(`output_context_ids`). Decoding context + new tokens and keeping only what the new tokens add gets
the spaces right that tokenizers attach to a token (decoding a token alone drops them: the classic
"no white space in streaming mode" bug), and multi-byte UTF-8 characters split across tokens are
held back until complete (the U+FFFD an incomplete trailing character decodes to is not emitted).
Non-streamed output goes through the same function, so streamed pieces concatenate to exactly the
non-streamed text.
"""

from __future__ import annotations

from pathlib import Path

from transformers import PreTrainedTokenizerBase

from tritonllm.tokenization import REPLACEMENT_CHAR, encode_prompt, load_tokenizer

# Tokens of context sent with each response: enough for any tokenizer's space / byte merging.
CONTEXT_TOKENS = 8


class TextCodec:
    """The tokenizer of one model, shared by preprocessing, postprocessing and the BLS."""

    def __init__(self, tokenizer_dir: str | Path, skip_special_tokens: bool = True):
        self.tokenizer: PreTrainedTokenizerBase = load_tokenizer(tokenizer_dir)
        self.skip_special_tokens = skip_special_tokens

    def encode(self, text: str, chat: bool = False) -> list[int]:
        """Prompt token ids; `chat` wraps the text as one user turn with the model's chat template."""
        return encode_prompt(self.tokenizer, text, chat=chat)

    def encode_words(self, words: list[str]) -> list[list[int]]:
        """Each stop/bad word as its own token sequence (no special tokens)."""
        return [ids for w in words if (ids := self.tokenizer.encode(w, add_special_tokens=False))]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def delta(self, context_ids: list[int], new_ids: list[int]) -> str:
        """The text `new_ids` add after `context_ids` (see the module docstring)."""
        if not new_ids:
            return ""
        prefix = _hold_back(self.decode(context_ids)) if context_ids else ""
        full = _hold_back(self.decode(list(context_ids) + list(new_ids)))
        return full[len(prefix) :] if len(full) > len(prefix) else ""


def _hold_back(text: str) -> str:
    """Drop the one U+FFFD that an incomplete trailing UTF-8 sequence decodes to.

    Only one: earlier replacement characters come from bytes that can never become valid and are
    emitted at once, so at most a few tokens are ever held back (always within the context window).
    """
    return text[:-1] if text.endswith(REPLACEMENT_CHAR) else text
