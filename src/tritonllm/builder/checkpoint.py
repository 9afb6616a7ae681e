"""Check a HF checkpoint before building: architecture, tensor shapes, tokenizer; hash its content."""

from __future__ import annotations

import hashlib
from pathlib import Path

from safetensors import safe_open
from tqdm import tqdm

from tritonllm.builder.options import BuildError
from tritonllm.model.args import ModelArgs, UnsupportedModelError
from tritonllm.model.loader import read_model_args

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
)
HASHED_FILES = ("config.json", "generation_config.json", *TOKENIZER_FILES)


def tensor_shapes(path: Path) -> dict[str, list[int]]:
    shapes = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                shapes[name] = list(f.get_slice(name).get_shape())
    return shapes


def expected_shapes(args: ModelArgs) -> dict[str, list[int]]:
    """The shape of every weight the engine needs (biases and the untied head are checked by the loader)."""
    h, hd, inter = args.hidden_size, args.head_dim, args.intermediate_size
    shapes = {"model.embed_tokens.weight": [args.vocab_size, h], "model.norm.weight": [h]}
    for i in range(args.num_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": [args.num_heads * hd, h],
            p + "self_attn.k_proj.weight": [args.num_kv_heads * hd, h],
            p + "self_attn.v_proj.weight": [args.num_kv_heads * hd, h],
            p + "self_attn.o_proj.weight": [h, args.num_heads * hd],
            p + "mlp.gate_proj.weight": [inter, h],
            p + "mlp.up_proj.weight": [inter, h],
            p + "mlp.down_proj.weight": [h, inter],
            p + "input_layernorm.weight": [h],
            p + "post_attention_layernorm.weight": [h],
        }
    return shapes


def validate_checkpoint(path: Path) -> ModelArgs:
    """The model's hyper-parameters; a BuildError naming the problem if the engine cannot run it."""
    try:
        args = read_model_args(path)
    except UnsupportedModelError as exc:
        raise BuildError(f"--model {path}: {exc}") from None
    if not any(path.glob("*.safetensors")):
        raise BuildError(f"--model {path} has no *.safetensors weights (convert .bin checkpoints first)")
    if not any((path / name).is_file() for name in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        raise BuildError(f"--model {path} has no tokenizer (tokenizer.json, tokenizer.model or vocab.json)")
    shapes = tensor_shapes(path)
    for name, shape in expected_shapes(args).items():
        if name not in shapes:
            raise BuildError(f"--model {path}: tensor {name} is missing")
        if shapes[name] != shape:
            raise BuildError(
                f"--model {path}: tensor {name} has shape {shapes[name]}, config.json implies {shape}"
            )
    return args


def checkpoint_sha256(path: Path) -> str:
    """SHA-256 over the weights, config and tokenizer files (names and contents, in a fixed order)."""
    files = sorted(path.glob("*.safetensors")) + [path / n for n in HASHED_FILES if (path / n).is_file()]
    digest = hashlib.sha256()
    with tqdm(
        total=sum(f.stat().st_size for f in files), unit="B", unit_scale=True, desc="hash checkpoint"
    ) as bar:
        for file in files:
            digest.update(file.name.encode() + b"\0")
            with file.open("rb") as f:
                while chunk := f.read(1 << 22):
                    digest.update(chunk)
                    bar.update(len(chunk))
    return digest.hexdigest()
