"""Shared fixtures: tiny random checkpoints for fast tests, the real SmolLM2 for ``slow`` ones."""

from __future__ import annotations

from pathlib import Path

import pytest
from tiny_model import build_tiny_model

# The shared real Triton server fixture (`triton_server`) and its helpers.
pytest_plugins = ["triton_fixture"]

LLAMA3_ROPE_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 128,
}


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Llama with GQA and untied embeddings, plain RoPE."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny_llama"), arch="llama")


@pytest.fixture(scope="session")
def tiny_llama_tied_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Llama with tied embeddings and llama3 RoPE scaling (the Llama 3.x layout)."""
    return build_tiny_model(
        tmp_path_factory.mktemp("tiny_llama_tied"),
        arch="llama",
        tie_word_embeddings=True,
        rope_scaling=LLAMA3_ROPE_SCALING,
        seed=1,
    )


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen2: q/k/v projections carry biases, no BOS is added."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny_qwen2"), arch="qwen2", seed=2)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The real default model (converted on first use); tests using it should be marked ``slow``."""
    from tritonllm.default_model import default_model_path

    return default_model_path()
