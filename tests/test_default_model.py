"""The default-model cache: converted once, validated by its manifest, never left half-written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tritonllm import default_model
from tritonllm.default_model import MANIFEST_FILE, is_valid, prepare, write_manifest

HEADER = {"format": 1, "source": {"file": "x.gguf", "size": 3, "sha256": "abc"}, "transformers": "1"}


def test_manifest_validation(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"12345")
    assert not is_valid(tmp_path, HEADER)  # no manifest yet
    write_manifest(tmp_path, HEADER)
    assert is_valid(tmp_path, HEADER)
    assert json.loads((tmp_path / MANIFEST_FILE).read_text())["files"] == {"model.safetensors": 5}
    assert not is_valid(tmp_path, {**HEADER, "transformers": "2"})
    (tmp_path / "model.safetensors").write_bytes(b"123")
    assert not is_valid(tmp_path, HEADER)  # size changed
    (tmp_path / MANIFEST_FILE).write_text("{not json")
    assert not is_valid(tmp_path, HEADER)


def test_interrupted_conversion_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gguf = tmp_path / "fake.gguf"
    gguf.write_bytes(b"gguf")

    def broken_convert(src: Path, out_dir: Path) -> None:
        (out_dir / "model.safetensors").write_bytes(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(default_model, "_convert", broken_convert)
    target = tmp_path / "models" / "M"
    with pytest.raises(KeyboardInterrupt):
        prepare(target, gguf=gguf)
    assert not target.exists()
    assert [p.name for p in target.parent.iterdir()] == [".M.lock"]


@pytest.mark.slow
def test_cache_is_valid_and_reused(smollm2_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert smollm2_dir == default_model.default_model_dir().resolve()
    assert is_valid(smollm2_dir, default_model._expected_header(default_model.find_gguf()))
    before = {p.name: p.stat().st_mtime_ns for p in smollm2_dir.iterdir()}

    def no_convert(src: Path, out_dir: Path) -> None:
        raise AssertionError("a valid cache must not be converted again")

    monkeypatch.setattr(default_model, "_convert", no_convert)
    assert default_model.default_model_path() == smollm2_dir
    assert {p.name: p.stat().st_mtime_ns for p in smollm2_dir.iterdir()} == before


@pytest.mark.slow
def test_greedy_paris(smollm2_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    assert tokenizer.bos_token_id not in ids[0].tolist()  # SmolLM2 adds no BOS
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
    assert tokenizer.decode(out[0, ids.shape[1] :]).startswith(" Paris")


@pytest.mark.slow
def test_chat_template(smollm2_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    assert tokenizer.chat_template
    assert tokenizer.eos_token == "<|im_end|>"
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert "<|im_start|>user\nHi<|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")
