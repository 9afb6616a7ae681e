"""A Llama checkpoint with random weights at a real model's shapes, for speed runs beyond the default model.

No weights may be downloaded here, and decode speed does not depend on the weights' values (requests ignore
EOS and run to their exact length), so a random model of, say, Llama-3.2-1B's shapes measures how the engine
and its peers scale. The tokenizer is the default model's (SmolLM2, vocabulary 49,152), so the embedding and
the lm_head are smaller than the real model's (Llama 3's vocabulary is 128,256): say so next to any figure.

    .venv/bin/python benchmarks/random_llama.py --shape llama-3.2-1b      # ~20 s, 2.1 GB in bf16
    .venv/bin/python benchmarks/bench_peers.py --model .cache/models/RandomLlama-3.2-1B --workloads b1,c32
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tritonllm.default_model import model_path_or_default

# Layer shapes of the named models (their configs on the Hugging Face hub); the vocabulary is the tokenizer's.
SHAPES = {
    "llama-3.2-1b": dict(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, tie_word_embeddings=True,
    ),
    "llama-3.2-3b": dict(
        hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
        num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
    ),
}  # fmt: skip
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)
REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.2-1b")
    parser.add_argument("--out", type=Path, help="folder (default: .cache/models/Random<Shape>)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    tokenizer_dir = Path(model_path_or_default(None))
    name = "Random" + args.shape.replace("llama", "Llama").replace("b", "B")  # RandomLlama-3.2-1B
    out = args.out or REPO / ".cache" / "models" / name
    vocab = LlamaConfig.from_pretrained(tokenizer_dir).vocab_size
    config = LlamaConfig(
        vocab_size=vocab, max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0,
        bos_token_id=1, eos_token_id=2, pad_token_id=2, **SHAPES[args.shape],
    )  # fmt: skip
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(config).to(torch.bfloat16)  # HF's init: normal(0, 0.02)
    model.save_pretrained(out, safe_serialization=True)
    for file in TOKENIZER_FILES:
        if (tokenizer_dir / file).exists():
            shutil.copy(tokenizer_dir / file, out / file)
    params = sum(p.numel() for p in model.parameters())
    print(f"wrote {out}: {params / 1e9:.2f} B parameters, vocabulary {vocab} (random weights)")


if __name__ == "__main__":
    main()
