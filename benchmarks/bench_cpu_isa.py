"""The engine's CPU kernels per instruction set on this CPU: each build (`generic`, `avx2`, `avx512`, as far
as the CPU runs them) side by side, per quantization, at batch 1 and 32 at once.

    .venv/bin/python benchmarks/bench_cpu_isa.py --threads 2 --out results/cpu_isa.json

Each (instruction set, quantization) runs in its own process (`TRITONLLM_CPU_ISA` picks the build at start),
round after round in rotating order; figures are output tokens/s, greedy with exact lengths, the median over
rounds. The model is the default one when it is prepared here, else SmolLM2-135M's architecture with random
weights (speed does not depend on the values). Prints the CPU flags with the table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

PROMPT_LEN, OUTPUT_LEN = 128, 64
WORKLOADS = {"batch1": 1, "concurrent32": 32}


def worker(model: str, quantization: str, threads: int) -> dict[str, float | str]:
    """In the child: one engine on the build TRITONLLM_CPU_ISA names; tok/s per workload after a warm-up."""
    import random

    from tritonllm.engine import EngineConfig, LLMEngine, SamplingParams

    engine = LLMEngine(
        EngineConfig(
            model=model,
            dtype="auto",
            quantization=quantization,
            num_threads=threads,
            enable_prefix_caching=False,
        )
    )
    rng = random.Random(0)
    params = SamplingParams(max_tokens=OUTPUT_LEN, temperature=0.0, ignore_eos=True)
    engine.generate([[rng.randrange(3, 20000) for _ in range(PROMPT_LEN)]], SamplingParams(max_tokens=4))
    result: dict[str, float | str] = {"kernels": engine.stats().kernels, "dtype": engine.stats().dtype}
    for name, batch in WORKLOADS.items():
        prompts = [[rng.randrange(3, 20000) for _ in range(PROMPT_LEN)] for _ in range(batch)]
        start = time.perf_counter()
        outputs = engine.generate(prompts, params)
        result[name] = sum(len(o) for o in outputs) / (time.perf_counter() - start)
    return result


def model_dir(tmp: Path) -> str:
    """The default model if it is prepared, else SmolLM2-135M's shape with random weights."""
    from bench_cuda import random_smollm2

    from tritonllm.default_model import default_model_dir

    if (default_model_dir() / "config.json").is_file():
        return str(default_model_dir())

    return str(random_smollm2(tmp / "random_smollm2"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="HF checkpoint or engine directory (default: see above)")
    p.add_argument("--isas", help="comma-separated builds (default: all this CPU runs)")
    p.add_argument("--quantizations", default="int8,none")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path)
    p.add_argument("--worker", nargs=3, metavar=("MODEL", "QUANTIZATION", "THREADS"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker[0], args.worker[1], int(args.worker[2]))))
        return 0

    from tritonllm.model.cpu_kernels import cpu_flags, supported_isas

    isas = args.isas.split(",") if args.isas else supported_isas()
    configs = [(isa, q) for isa in isas for q in args.quantizations.split(",")]
    flags = " ".join(cpu_flags())
    print(f"CPU flags: {flags}; threads {args.threads}; builds {isas}", flush=True)
    runs: dict[tuple[str, str], list[dict]] = {c: [] for c in configs}
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or model_dir(Path(tmp))
        for r in range(args.rounds):
            for isa, quantization in configs[r % len(configs) :] + configs[: r % len(configs)]:
                env = {**os.environ, "TRITONLLM_CPU_ISA": isa}
                command = [sys.executable, __file__, "--worker", model, quantization, str(args.threads)]
                done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)
                if done.returncode != 0:
                    print(done.stderr[-2000:], file=sys.stderr)
                    return 1
                result = json.loads(done.stdout.strip().splitlines()[-1])
                runs[(isa, quantization)].append(result)
                rates = " ".join(f"{w} {result[w]:.1f}" for w in WORKLOADS)
                print(f"round {r + 1}/{args.rounds} {isa:8s} {quantization:5s} {rates} tok/s", flush=True)
    table = {}
    for (isa, quantization), results in runs.items():
        row = {w: round(statistics.median(x[w] for x in results), 1) for w in WORKLOADS}
        row |= {"kernels": results[0]["kernels"], "dtype": results[0]["dtype"]}
        table[f"{isa}/{quantization}"] = row
        print(
            f"{isa:8s} {quantization:5s} {row['dtype']:9s} "
            + " ".join(f"{w} {row[w]:8.1f}" for w in WORKLOADS)
        )
    report = {"cpu_flags": flags, "threads": args.threads, "results": table}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
