"""The project's engine format: built from a checkpoint that is then deleted, it loads and runs alone.

`none` must match HF transformers token for token; `int8_wo` and `fp8` must equal quantizing the HF
checkpoint at load (the stored weights and scales are exact) and stay within the agreement measured
against the unquantized HF model.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from build_engine_helpers import build_without_source
from engine_helpers import agreement_before_divergence, greedy, hf_greedy, make_engine, random_prompts
from safetensors import safe_open

from tritonllm.builder.checkpoint import checkpoint_sha256
from tritonllm.builder.torch_engine import WEIGHTS_FILE
from tritonllm.engine import EngineConfig
from tritonllm.engine_format import read_build_info
from tritonllm.model.args import UnsupportedModelError
from tritonllm.model.cpu_kernels import load_kernels, selected_isa
from tritonllm.precision import TORCH_QUANTIZATIONS
from tritonllm.triton.models.tensorrt_llm import engine_config

NUM_PROMPTS, MAX_NEW = 12, 16
# Mean fraction of greedy tokens before the first divergence from unquantized HF, on the tiny random
# Llama (measured 0.70 int8_wo and 0.46 fp8 with these prompts, int8 0.84 and int4 0.17 on 2026-12-05, int7
# 0.61 on 2026-12-07; random weights make near-ties common).
MIN_AGREEMENT = {"int8_wo": 0.5, "fp8": 0.3, "int8": 0.5, "int7": 0.3, "int4": 0.05}


@pytest.fixture(scope="module")
def engines(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return build_without_source(tiny_llama_dir, tmp_path_factory.mktemp("tiny_engines"), TORCH_QUANTIZATIONS)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(NUM_PROMPTS, vocab=512, seed=11)


def test_engine_dir_records_what_was_built(engines: dict[str, Path], tiny_llama_dir: Path) -> None:
    info = read_build_info(engines["int8_wo"])
    assert info is not None
    assert (info["backend"], info["architecture"], info["quantization"], info["dtype"]) == (
        "torch",
        "LlamaForCausalLM",
        "int8_wo",
        "float32",
    )
    assert info["limits"] == {
        "max_batch_size": 64,
        "max_input_len": 256,
        "max_seq_len": 512,
        "max_num_tokens": 512,
        "tokens_per_block": 16,
    }
    assert info["source"]["sha256"] == checkpoint_sha256(tiny_llama_dir)  # same files, same content
    assert {"tritonllm", "torch", "transformers"} <= set(info["versions"])
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", WEIGHTS_FILE):
        assert (engines["int8_wo"] / name).is_file(), name


@pytest.mark.parametrize(("quantization", "dtype"), [("int8_wo", torch.int8), ("fp8", torch.float8_e4m3fn)])
def test_linears_are_stored_quantized_with_scales(engines: dict[str, Path], quantization: str, dtype) -> None:
    with safe_open(str(engines[quantization] / WEIGHTS_FILE), framework="pt") as f:
        names = set(f.keys())
        q = f.get_tensor("model.layers.0.self_attn.q_proj.weight")
        scale = f.get_tensor("model.layers.0.self_attn.q_proj.weight_scale")
        assert q.dtype == dtype and scale.dtype == torch.float32 and scale.shape == (q.shape[0],)
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.float32  # not a linear: kept
        assert "lm_head.weight_scale" in names
    sizes = {q: (engines[q] / WEIGHTS_FILE).stat().st_size for q in TORCH_QUANTIZATIONS}
    assert sizes[quantization] < sizes["none"]


def test_int4_stores_nibbles_in_blocks_of_32_and_an_int8_head(engines: dict[str, Path]) -> None:
    with safe_open(str(engines["int4"] / WEIGHTS_FILE), framework="pt") as f:
        q = f.get_tensor("model.layers.0.mlp.down_proj.weight")
        scale = f.get_tensor("model.layers.0.mlp.down_proj.weight_scale")
        assert q.dtype == torch.uint8 and (q.shape[1] * 2) % 32 == 0  # two 4-bit weights a byte
        assert scale.shape == (q.shape[0], q.shape[1] * 2 // 32)
        head, head_scale = f.get_tensor("lm_head.weight"), f.get_tensor("lm_head.weight_scale")
        assert head.dtype == torch.int8 and head_scale.shape[1] == head.shape[1] // 32
    sizes = {q: (engines[q] / WEIGHTS_FILE).stat().st_size for q in ("int4", "int8")}
    assert sizes["int4"] < sizes["int8"]


@pytest.mark.parametrize(("quantization", "steps"), [("int8", 127), ("int7", 63)])
def test_int8_blocks_store_blocks_of_32_head_included(
    engines: dict[str, Path], quantization: str, steps: int
) -> None:
    """int8 and int7 store int8 blocks of 32 (int7's within 63 steps), and an int8 head (127 steps)."""
    with safe_open(str(engines[quantization] / WEIGHTS_FILE), framework="pt") as f:
        q = f.get_tensor("model.layers.0.mlp.down_proj.weight")
        scale = f.get_tensor("model.layers.0.mlp.down_proj.weight_scale")
        assert q.dtype == torch.int8 and q.shape[1] % 32 == 0 and q.abs().max() == steps
        assert scale.shape == (q.shape[0], q.shape[1] // 32)
        head, head_scale = f.get_tensor("lm_head.weight"), f.get_tensor("lm_head.weight_scale")
        assert head.dtype == torch.int8 and head_scale.shape[1] == head.shape[1] // 32
        assert head.abs().max() == 127


def test_unquantized_engine_matches_hf_token_for_token(
    engines: dict[str, Path], tiny_llama_dir: Path, prompts: list[list[int]]
) -> None:
    got = make_engine(engines["none"]).generate(prompts, greedy(MAX_NEW))
    assert got == [hf_greedy(tiny_llama_dir, p, MAX_NEW) for p in prompts]


@pytest.mark.parametrize("quantization", ["int8", "int7", "int4", "int8_wo", "fp8"])
def test_quantized_engine_equals_quantizing_at_load(
    engines: dict[str, Path], tiny_llama_dir: Path, prompts: list[list[int]], quantization: str
) -> None:
    engine = make_engine(engines[quantization])
    assert engine.config.quantization == quantization  # taken from the engine directory
    got = engine.generate(prompts, greedy(MAX_NEW))
    assert got == make_engine(tiny_llama_dir, quantization=quantization).generate(prompts, greedy(MAX_NEW))
    agreement = agreement_before_divergence(got, [hf_greedy(tiny_llama_dir, p, MAX_NEW) for p in prompts])
    assert agreement >= MIN_AGREEMENT[quantization], f"{quantization}: agreement {agreement:.2f}"


@pytest.mark.parametrize("fixture", ["tiny_llama_tied_dir", "tiny_qwen2_dir"])
def test_tied_head_and_biases_survive_quantized_storage(
    request: pytest.FixtureRequest, tmp_path: Path, fixture: str, prompts: list[list[int]]
) -> None:
    """Tied embeddings store the head quantized next to the full embedding; Qwen2 keeps its q/k/v biases."""
    src = request.getfixturevalue(fixture)
    engine_dir = build_without_source(src, tmp_path, ["int8_wo"])["int8_wo"]
    got = make_engine(engine_dir).generate(prompts, greedy(8))
    assert got == make_engine(src, quantization="int8_wo").generate(prompts, greedy(8))


def test_quantized_engine_dir_refuses_another_quantization(engines: dict[str, Path]) -> None:
    with pytest.raises(UnsupportedModelError, match=r"holds fp8 weights .* not 'int8_wo': rebuild"):
        make_engine(engines["fp8"], quantization="int8_wo")


def test_engine_dir_limits_become_the_triton_engine_defaults(engines: dict[str, Path]) -> None:
    config = engine_config({"engine_dir": str(engines["int8_wo"]), "max_num_seqs": "", "num_threads": "1"})
    assert (config.quantization, config.max_model_len, config.max_num_seqs) == ("int8_wo", 512, 64)
    assert (config.max_num_batched_tokens, config.tokens_per_block) == (512, 16)
    explicit = engine_config(
        {"engine_dir": str(engines["int8_wo"]), "max_num_seqs": "8", "tokens_per_block": "4"}
    )
    assert (explicit.max_num_seqs, explicit.tokens_per_block) == (8, 4)


def test_plain_checkpoint_dirs_still_default_to_no_quantization(tiny_llama_dir: Path) -> None:
    assert EngineConfig(model=str(tiny_llama_dir)).quantization == "none"
    assert engine_config({"engine_dir": str(tiny_llama_dir)}).max_model_len is None


def test_auto_quantization_keeps_what_was_built_else_int8_on_the_kernels(
    engines: dict[str, Path], tiny_llama_dir: Path
) -> None:
    """auto (the serving default): an engine directory loads as built, even unquantized; a checkpoint gets
    int8 where the CPU kernels run (faster than bf16 at every batch size, closer to fp32), fp32 activations
    (bf16 on the amx build)."""
    for built in ("none", "fp8"):
        assert EngineConfig(model=str(engines[built]), quantization="auto").quantization == built
    config = EngineConfig(model=str(tiny_llama_dir), quantization="auto", dtype="auto")
    if load_kernels() is None:
        assert (config.quantization, config.dtype) == ("none", "float32")
    else:
        activations = "bfloat16" if selected_isa() == "amx" else "float32"
        assert (config.quantization, config.dtype) == ("int8", activations)


def test_an_engine_built_for_an_int8_kv_cache_serves_with_one(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """`--kv-cache-dtype int8` on the project's engine is recorded, and the engine (Triton's included) then
    keeps int8 rows unless told otherwise."""
    built = build_without_source(tiny_llama_dir, tmp_path, ["int8"], kv_cache_dtype="int8")["int8"]
    assert read_build_info(built)["kv_cache_dtype"] == "int8"
    assert EngineConfig(model=str(built)).kv_cache_dtype == "int8"
    assert engine_config({"engine_dir": str(built), "num_threads": "1"}).kv_cache_dtype == "int8"
    assert engine_config({"engine_dir": str(built), "kv_cache_dtype": "float32"}).kv_cache_dtype == "float32"
    engine = make_engine(built)
    assert engine.runner.kv_cache.dtype == torch.int8
    assert len(engine.generate([[5, 6, 7, 8]], greedy(6))[0]) == 6
