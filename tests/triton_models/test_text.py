"""Stateless incremental detokenization: streamed pieces concatenate to the whole text."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tritonllm.tokenization import REPLACEMENT_CHAR
from tritonllm.triton.text import CONTEXT_TOKENS, TextCodec


@pytest.fixture(scope="module")
def codec(tiny_llama_dir: Path) -> TextCodec:
    return TextCodec(tiny_llama_dir)


def stream_text(codec: TextCodec, prompt: list[int], output: list[int], chunk: int) -> str:
    """What the engine model + postprocessing produce when streaming `output` `chunk` tokens at a time."""
    context, pieces = prompt[-CONTEXT_TOKENS:], []
    for i in range(0, len(output), chunk):
        new = output[i : i + chunk]
        pieces.append(codec.delta(context, new))
        context = (context + new)[-CONTEXT_TOKENS:]
    return "".join(pieces)


def test_spaces_and_multibyte_survive_streaming(codec: TextCodec) -> None:
    prompt = codec.encode("The quick brown")
    output = codec.tokenizer.encode(" fox jumps: Ärger über Öl 🙂 ¿Qué tal?", add_special_tokens=False)
    whole = codec.delta(prompt[-CONTEXT_TOKENS:], output)
    assert whole == " fox jumps: Ärger über Öl 🙂 ¿Qué tal?"
    for chunk in (1, 2, 3):
        assert stream_text(codec, prompt, output, chunk) == whole


def test_random_token_streams_match_whole_decode(codec: TextCodec) -> None:
    rng = random.Random(0)
    vocab = len(codec.tokenizer)
    for _ in range(50):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(1, 12))]
        output = [rng.randrange(3, vocab) for _ in range(rng.randint(1, 30))]
        whole = codec.delta(prompt[-CONTEXT_TOKENS:], output)
        assert stream_text(codec, prompt, output, 1) == whole


def test_long_runs_of_invalid_bytes_are_not_lost(codec: TextCodec) -> None:
    """More undecodable tokens in a row than the context window holds (a random model makes these)."""
    invalid = [i for i in range(len(codec.tokenizer)) if codec.decode([i]) == REPLACEMENT_CHAR]
    assert invalid, "byte-level BPE has lone continuation bytes"
    prompt = codec.encode("The quick")
    output = [invalid[0]] * 13 + codec.tokenizer.encode(" brown fox", add_special_tokens=False) + invalid[:3]
    whole = codec.delta(prompt[-CONTEXT_TOKENS:], output)
    assert whole.startswith(REPLACEMENT_CHAR * 13 + " brown fox")
    for chunk in (1, 2, 5):
        assert stream_text(codec, prompt, output, chunk) == whole


def test_encode_words_skips_empty(codec: TextCodec) -> None:
    words = codec.encode_words(["fox", "", " dog"])
    assert len(words) == 2 and all(words)
