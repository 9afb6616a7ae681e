"""Build a `LlamaModel` from a HF checkpoint directory (config.json + *.safetensors) or an engine directory.

An engine directory (`build_engines/build.py`) holds its linears already quantized (`<name>.weight` in
int8 or float8_e4m3fn with `<name>.weight_scale`), so loading it skips quantization.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from tritonllm.engine_format import SCALE_SUFFIX, built_quantization
from tritonllm.model.args import ModelArgs, UnsupportedModelError
from tritonllm.model.huge_pages import move_weights_to_huge_pages
from tritonllm.model.llama import DecoderLayer, LlamaModel
from tritonllm.model.quant import (
    Bf16Linear,
    head_quantization,
    make_linear,
    prequantized_linear,
    runs_on_kernels,
)
from tritonllm.precision import DTYPES

TORCH_DTYPES = {name: getattr(torch, name) for name in DTYPES if name != "auto"}


def read_model_args(path: str | Path) -> ModelArgs:
    """Hyper-parameters, with EOS ids from generation_config.json when it has them."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise UnsupportedModelError(f"{path} has no config.json: not a HF checkpoint directory")
    config = json.loads((path / "config.json").read_text())
    gen_path = path / "generation_config.json"
    if gen_path.is_file():
        eos = json.loads(gen_path.read_text()).get("eos_token_id")
        if eos is not None:
            config = {**config, "eos_token_id": eos}
    return ModelArgs.from_hf_config(config)


def _load_tensors(path: Path) -> dict[str, torch.Tensor]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise UnsupportedModelError(f"{path} has no *.safetensors weights")
    tensors = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                tensors[name] = f.get_tensor(name)
    return tensors


def load_model(
    path: str | Path, dtype: str = "float32", device: str = "cpu", quantization: str = "none"
) -> LlamaModel:
    path = Path(path)
    args = read_model_args(path)
    built = built_quantization(path)
    prequantized = built not in (None, "none")
    if prequantized and quantization != built:
        raise UnsupportedModelError(
            f"{path} holds {built} weights (an engine directory); it runs with quantization={built!r}, "
            f"not {quantization!r}: rebuild it with build_engines/build.py for another quantization"
        )
    tensors = _load_tensors(path)
    torch_dtype = TORCH_DTYPES[dtype]

    def take(name: str, required: bool = True) -> torch.Tensor | None:
        if name not in tensors:
            if required:
                raise UnsupportedModelError(f"checkpoint is missing tensor {name!r}")
            return None
        return tensors.pop(name).to(device=device, dtype=torch_dtype)

    def cat(*names: str, required: bool = True) -> torch.Tensor | None:
        parts = [take(n, required) for n in names]
        return None if any(p is None for p in parts) else torch.cat(parts, dim=0)

    def linear(prefixes: list[str], has_bias: bool, stored: str | None = built) -> torch.nn.Module:
        """One linear over the output channels of `prefixes` (q, k, v fused; gate and up fused); `stored`:
        the quantization its stored weights are in (a directory's head may differ: int8 under int7)."""
        weights = [n + ".weight" for n in prefixes]
        bias = cat(*(n + ".bias" for n in prefixes)) if has_bias else None
        if not prequantized:
            return make_linear(cat(*weights), bias, quantization)
        for name in weights:
            if name not in tensors or name + SCALE_SUFFIX not in tensors:
                raise UnsupportedModelError(f"engine directory is missing tensor {name!r} or its scale")
        weight = torch.cat([tensors.pop(n).to(device) for n in weights])
        scale = torch.cat([tensors.pop(n + SCALE_SUFFIX).to(device) for n in weights])
        return prequantized_linear(weight, scale, bias, torch_dtype, stored)

    layers = []
    for i in range(args.num_layers):
        p = f"model.layers.{i}."
        attn = [p + f"self_attn.{n}_proj" for n in "qkv"]
        mlp = [p + f"mlp.{n}_proj" for n in ("gate", "up")]
        linears = {
            "qkv": linear(attn, args.qkv_bias),
            "o": linear([p + "self_attn.o_proj"], args.o_bias),
            "gate_up": linear(mlp, args.mlp_bias),
            "down": linear([p + "mlp.down_proj"], args.mlp_bias),
        }
        norms = {
            "input": take(p + "input_layernorm.weight"),
            "post_attention": take(p + "post_attention_layernorm.weight"),
        }
        layers.append(DecoderLayer(args, linears, norms))
    embed = take("model.embed_tokens.weight")
    if prequantized and "lm_head.weight" + SCALE_SUFFIX in tensors:  # stored quantized, tied or not
        lm_head = linear(["lm_head"], False, head_quantization(built))
    elif prequantized:  # stored unquantized (int8 engine directories built before the head was int8)
        lm_head = make_linear(tensors.pop("lm_head.weight").to(device), None, built)
    else:
        lm_weight = embed if args.tie_word_embeddings else take("lm_head.weight", required=False)
        if lm_weight is None:  # some checkpoints tie without saying so
            lm_weight = embed
        lm_head = make_linear(lm_weight, None, head_quantization(quantization))
        if lm_weight is embed and isinstance(lm_head, Bf16Linear) and lm_head.packed:
            embed = None  # the packed head holds the only copy of the rows (LlamaModel.embed_tokens)
    hf_config = AutoConfig.from_pretrained(path)
    inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[args.rope_type](hf_config, device)
    model = LlamaModel(args, embed, layers, take("model.norm.weight"), lm_head, inv_freq, attention_scaling)
    leftover = [n for n in tensors if not n.endswith("rotary_emb.inv_freq")]
    if leftover:
        raise UnsupportedModelError(f"checkpoint has tensors the engine does not use: {leftover[:5]}")
    streamed = [m for layer in layers for m in layer.linears] + [lm_head]  # in the order a step reads them
    # A row-major bf16 head tied to the embedding stays where the embedding is (one copy).
    shared = None if embed is None else embed.data_ptr()
    kernel_read = [m for m in streamed if runs_on_kernels(m) and m.weight.data_ptr() != shared]
    move_weights_to_huge_pages(kernel_read)
    return model.eval()
