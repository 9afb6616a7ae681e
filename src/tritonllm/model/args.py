"""Model hyper-parameters read from a HF `config.json`, for the architectures the engine supports."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


class UnsupportedModelError(ValueError):
    """The checkpoint is not one the engine can run; the message says what is missing."""


@dataclass(frozen=True)
class ModelArgs:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    rope_type: str
    eos_token_ids: tuple[int, ...]
    hf_config: dict[str, Any] = field(repr=False, compare=False, default_factory=dict)

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> ModelArgs:
        archs = config.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise UnsupportedModelError(
                f"unsupported architecture {archs}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        rope_scaling = config.get("rope_scaling") or {}
        rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModelError(f"unsupported rope_scaling type {rope_type!r}")
        num_heads = config["num_attention_heads"]
        sliding = config.get("sliding_window") if config.get("use_sliding_window", True) else None
        max_pos = config.get("max_position_embeddings", 2048)
        if arch != "LlamaForCausalLM" and sliding and sliding < max_pos:
            max_pos = sliding  # full attention is exact only within the window
        eos = config.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        is_qwen2 = arch == "Qwen2ForCausalLM"
        attention_bias = bool(config.get("attention_bias", False))
        return cls(
            architecture=arch,
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=config.get("num_key_value_heads") or num_heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // num_heads,
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=is_qwen2 or attention_bias,
            o_bias=attention_bias and not is_qwen2,
            mlp_bias=bool(config.get("mlp_bias", False)),
            rope_type=rope_type,
            eos_token_ids=eos_ids,
            hf_config=config,
        )
