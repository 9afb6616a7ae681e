"""Where an engine's time goes on one of bench_peers' workloads, in-process: its steps by kind.

Runs the workload's requests (the same token ids bench_peers sends, all at once) through an `LLMEngine` on
this thread, `--rounds` times, and sorts each step by what it carried: prefill tokens only, prefill with
decodes, or decodes only (by batch size, rounded up to 16). Per kind: steps, seconds and share of the wall
time, ms a step, tokens. Engine options as `tritonllm launch` serves them, plus `--kv-cache-dtype` and
`--max-num-batched-tokens` to compare. Prefix caching is off, so every round does the same work.

    .venv/bin/python benchmarks/bench_step_kinds.py --workload mixed --rounds 2 --kv-cache-dtype int8
"""

from __future__ import annotations

import argparse
import collections
import json
import time
from dataclasses import dataclass
from pathlib import Path

from bench_serving_paths import add_engine_arguments
from peers.workloads import Scale, make_workloads

from tritonllm.default_model import model_path_or_default
from tritonllm.engine.config import EngineConfig
from tritonllm.engine.llm_engine import LLMEngine
from tritonllm.engine.sampling_params import SamplingParams
from tritonllm.engine.scheduler import SchedulerOutput
from tritonllm.model.cpu_kernels import cpu_flags


@dataclass
class Kind:
    steps: int = 0
    seconds: float = 0.0
    prefill_tokens: int = 0
    decode_tokens: int = 0


def kind_of(plan: SchedulerOutput) -> tuple[str, int, int]:
    decodes = sum(1 for c in plan.chunks if c.num_tokens == 1)
    prefill = plan.num_tokens - decodes
    if prefill:
        return ("prefill + decode" if decodes else "prefill"), prefill, decodes
    return f"decode {(decodes + 15) // 16 * 16}", 0, decodes


def run_round(engine: LLMEngine, last: dict[str, SchedulerOutput], requests: list, tag: str) -> dict:
    for i, spec in enumerate(requests):
        params = SamplingParams(max_tokens=spec.max_tokens, min_tokens=spec.max_tokens, top_k=1)
        engine.add_request(f"{tag}-{i}", list(spec.prompt_ids), params)
    kinds: dict[str, Kind] = collections.defaultdict(Kind)
    output_tokens, started = 0, time.perf_counter()
    while engine.has_unfinished():
        step_started = time.perf_counter()
        outputs = engine.step()
        seconds = time.perf_counter() - step_started
        output_tokens += sum(len(o.new_token_ids) for o in outputs)
        name, prefill, decodes = kind_of(last["plan"])
        kind = kinds[name]
        kind.steps, kind.seconds = kind.steps + 1, kind.seconds + seconds
        kind.prefill_tokens, kind.decode_tokens = kind.prefill_tokens + prefill, kind.decode_tokens + decodes
    wall = time.perf_counter() - started
    by_kind = {name: vars(kind) for name, kind in sorted(kinds.items())}
    return {"wall_s": wall, "tok_s": output_tokens / wall, "kinds": by_kind}


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", help="HF checkpoint or engine directory (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--workload", default="mixed", help="a bench_peers workload (default: mixed)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--out", type=Path, help="also write the rounds to this JSON file")
    add_engine_arguments(parser)
    args = parser.parse_args()
    model = model_path_or_default(args.model)
    config = EngineConfig(
        model=model,
        dtype=args.dtype,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        num_threads=args.threads,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=False,
    )
    engine = LLMEngine(config)
    last: dict[str, SchedulerOutput] = {}  # the plan of the step that ran last (no list of every step's)
    schedule = engine.scheduler.schedule

    def recorded() -> SchedulerOutput:
        last["plan"] = schedule()
        return last["plan"]

    engine.scheduler.schedule = recorded  # type: ignore[method-assign]
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]  # as bench_peers reads it
    requests = list(make_workloads(vocab, 0, Scale())[args.workload].requests)
    print(f"{args.workload}: {len(requests)} requests; {config.dtype} {config.quantization}, "
          f"KV {config.kv_cache_dtype}; CPU flags {' '.join(cpu_flags())}", flush=True)  # fmt: skip
    rounds = []
    for r in range(args.rounds):
        result = run_round(engine, last, requests, f"r{r}")
        rounds.append(result)
        print(f"round {r}: {result['wall_s']:.2f} s, {result['tok_s']:.1f} output tok/s", flush=True)
        for name, k in result["kinds"].items():
            share, per_step = 100 * k["seconds"] / result["wall_s"], 1e3 * k["seconds"] / k["steps"]
            print(f"  {name:16s} {k['steps']:4d} steps {k['seconds']:6.2f} s ({share:4.1f}%) "
                  f"{per_step:6.1f} ms a step, prefill tokens {k['prefill_tokens']:6d}, "
                  f"decodes {k['decode_tokens']:6d}")  # fmt: skip
    if args.out:
        settings = {**vars(args), "out": str(args.out), "cpu_flags": cpu_flags()}
        args.out.write_text(json.dumps({"args": settings, "rounds": rounds}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
