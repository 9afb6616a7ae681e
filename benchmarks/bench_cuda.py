"""The engine on a CUDA GPU against HF transformers `generate()`, side by side in one process.

For a GPU machine (not CI): `python benchmarks/bench_cuda.py --out results/cuda.json`. The model has
SmolLM2-135M-Instruct's architecture (the numbers of its `config.json`) with random weights, because
a GPU check machine here can neither download nor carry the real weights.
Speed does not depend on the values; whether the engine's greedy tokens equal HF's on the GPU is checked
by the engine tests instead (`TRITONLLM_TEST_DEVICE=cuda pytest tests/test_engine_matches_hf.py`).

Workloads, greedy with EOS ignored so every request makes exactly its tokens: one request (prompt 128,
output 128) and 32 at once (128/128). The engine's prefix cache is off, as the timed runs repeat the
warm-up's prompts and HF has no such cache. HF runs the 32 as one padded batch (static batching). Figures are
output tokens per second, the median of `--runs` timed runs after one warm-up, GPU synchronised.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from tritonllm.engine import EngineConfig, LLMEngine, SamplingParams

SMOLLM2_SHAPE = {
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "vocab_size": 49152,
    "max_position_embeddings": 8192,
    "rope_theta": 100000.0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
}
PROMPT_LEN, OUTPUT_LEN, CONCURRENT = 128, 128, 32


def random_smollm2(out_dir: Path) -> Path:
    """SmolLM2-135M's architecture with seeded random weights, saved as an HF folder."""
    torch.manual_seed(0)
    config = LlamaConfig(**SMOLLM2_SHAPE, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(out_dir)
    return out_dir


def timed(fn: Callable[[], list[list[int]]], runs: int, device: str) -> tuple[float, int]:
    """Median seconds of `runs` calls after one warm-up, and the output tokens of one call."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    fn()
    seconds = []
    for _ in range(runs):
        sync()
        start = time.perf_counter()
        outputs = fn()
        sync()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds), sum(len(o) for o in outputs)


def hf_generate(model, prompts: list[list[int]]) -> list[list[int]]:
    ids = torch.tensor(prompts, device=model.device)  # equal lengths: no padding needed
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=OUTPUT_LEN,
            min_new_tokens=OUTPUT_LEN,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=2,
        )
    return out[:, PROMPT_LEN:].tolist()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--out", type=Path)
    p.add_argument("--device", default="cuda", help="cpu: a smoke run of this script without a GPU")
    p.add_argument("--requests", type=int, default=CONCURRENT, help="the concurrent workload's size")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_cuda: no CUDA device", file=sys.stderr)
        return 2
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 49152) for _ in range(PROMPT_LEN)] for _ in range(args.requests)]
    params = SamplingParams(max_tokens=OUTPUT_LEN, temperature=0.0, ignore_eos=True)
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    results: dict[str, float | str] = {"device": name, "torch": torch.__version__}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = random_smollm2(Path(tmp))
        engine = LLMEngine(
            EngineConfig(
                model=str(model_dir), dtype="bfloat16", device=args.device, enable_prefix_caching=False
            )
        )
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(args.device).eval()
        for workload, batch in (("batch1", prompts[:1]), (f"concurrent{args.requests}", prompts)):
            systems = {
                "engine": lambda b=batch: engine.generate(b, params),
                "hf": lambda b=batch: hf_generate(hf, b),
            }
            for system, fn in systems.items():
                seconds, tokens = timed(fn, args.runs, args.device)
                results[f"{system}_{workload}_tok_s"] = round(tokens / seconds, 1)
                print(
                    f"{system:6s} {workload:13s} {tokens / seconds:9.1f} tok/s ({seconds:.3f} s)", flush=True
                )
            results[f"ratio_{workload}"] = round(
                results[f"engine_{workload}_tok_s"] / results[f"hf_{workload}_tok_s"], 2
            )
    print(json.dumps(results, indent=1))
    if args.out:
        args.out.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
