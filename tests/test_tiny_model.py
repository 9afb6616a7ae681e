"""The tiny checkpoints load with plain transformers, so engine tests can trust them as references."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tiny_model import VOCAB_SIZE, build_tiny_model
from transformers import AutoModelForCausalLM, AutoTokenizer

FIXTURES = ["tiny_llama_dir", "tiny_llama_tied_dir", "tiny_qwen2_dir"]
TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "  leading spaces, tabs\tand\nnew lines\n\n",
    "unseen words: zyxwvut 987 ÅÆØ 日本語 🙂",
    "",
]


@pytest.fixture(params=FIXTURES)
def model_dir(request: pytest.FixtureRequest) -> Path:
    return request.getfixturevalue(request.param)


def test_model_loads_and_generates(model_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    config = model.config
    assert model.dtype == torch.float32
    assert config.vocab_size == len(tokenizer) == VOCAB_SIZE
    assert (config.num_attention_heads, config.num_key_value_heads) == (4, 2)

    ids = tokenizer("Triton serves models", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits
        out = model.generate(ids, max_new_tokens=8, do_sample=False, min_new_tokens=8)
    assert logits.shape == (1, ids.shape[1], VOCAB_SIZE)
    assert torch.isfinite(logits).all()
    assert out.shape == (1, ids.shape[1] + 8)


def test_variants(tiny_llama_dir: Path, tiny_llama_tied_dir: Path, tiny_qwen2_dir: Path) -> None:
    llama = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    assert llama.config.model_type == "llama"
    assert not llama.config.tie_word_embeddings
    assert not torch.equal(llama.lm_head.weight, llama.model.embed_tokens.weight)

    tied = AutoModelForCausalLM.from_pretrained(tiny_llama_tied_dir)
    assert tied.config.tie_word_embeddings
    assert tied.lm_head.weight.data_ptr() == tied.model.embed_tokens.weight.data_ptr()
    assert tied.config.rope_scaling["rope_type"] == "llama3"
    assert tied.config.rope_scaling["original_max_position_embeddings"] == 128

    qwen2 = AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir)
    assert qwen2.config.model_type == "qwen2"
    attn = qwen2.model.layers[0].self_attn
    for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
        assert proj.bias is not None and proj.bias.abs().sum() > 0


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_round_trip(model_dir: Path, text: str) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = tokenizer(text).input_ids
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    no_special = tokenizer(text, add_special_tokens=False).input_ids
    assert tokenizer.decode(no_special) == text


def test_special_tokens(tiny_llama_dir: Path, tiny_qwen2_dir: Path) -> None:
    llama = AutoTokenizer.from_pretrained(tiny_llama_dir)
    qwen2 = AutoTokenizer.from_pretrained(tiny_qwen2_dir)
    assert (llama.bos_token, llama.eos_token, llama.pad_token) == ("<s>", "</s>", "<pad>")
    assert llama("hi").input_ids[0] == llama.bos_token_id
    assert qwen2("hi").input_ids[0] != qwen2.bos_token_id
    prompt = llama.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert llama.decode(prompt).endswith("<s>assistant\n")


def test_builder_is_deterministic(tiny_qwen2_dir: Path, tmp_path: Path) -> None:
    again = build_tiny_model(tmp_path, arch="qwen2", seed=2)
    first = load_file(tiny_qwen2_dir / "model.safetensors")
    second = load_file(again / "model.safetensors")
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)
    assert (tiny_qwen2_dir / "tokenizer.json").read_text() == (again / "tokenizer.json").read_text()
