"""Incremental detokenization keeps spaces and multi-byte characters right; the CLI streams text."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tritonllm.tokenization import IncrementalDetokenizer, encode_prompt, load_tokenizer

TEXTS = [
    "Hello world, how are you?",
    "naïve café 日本語 🙂 emoji 👍🏽 done",
    "  spaces\n\nnew  lines\tand tabs",
    "def f(x):\n    return x * 2",
]


def streamed(tokenizer, context: list[int], ids: list[int]) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, context_ids=context)
    return [detok.push([i]) for i in ids] + [detok.flush()]


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "smollm2_dir"])
def test_streamed_pieces_join_to_the_full_text(request: pytest.FixtureRequest, fixture: str) -> None:
    tokenizer = load_tokenizer(request.getfixturevalue(fixture))
    context = tokenizer("Prompt: say")["input_ids"]
    for text in TEXTS:
        ids = tokenizer(" " + text, add_special_tokens=False)["input_ids"]
        pieces = streamed(tokenizer, context, ids)
        expected = tokenizer.decode(context + ids, skip_special_tokens=True)[
            len(tokenizer.decode(context, skip_special_tokens=True)) :
        ]
        assert "".join(pieces) == expected
        assert all("\ufffd" not in p for p in pieces), "no half characters in a streamed piece"


def test_chat_template_prompt(smollm2_dir: Path) -> None:
    tokenizer = load_tokenizer(smollm2_dir)
    text = tokenizer.decode(encode_prompt(tokenizer, "Hi there", chat=True))
    assert "Hi there" in text and text.rstrip().endswith("assistant")


@pytest.mark.parametrize("options", [[], ["--kv-cache-dtype", "int8"]], ids=["defaults", "int8-kv"])
def test_cli_generate_streams_text(tiny_llama_dir: Path, options: list[str]) -> None:
    cmd = [
        sys.executable,
        "-m",
        "tritonllm.cli",
        "generate",
        "--model",
        str(tiny_llama_dir),
        "--prompt",
        "The quick brown fox",
        "--max-tokens",
        "8",
        "--threads",
        "1",
        *options,
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip(), "some text was generated"
