"""A KV pool that has cycled: this tree's block allocator (A) against another tree's (B), in one process.

A long-running server's pool turns over: its free blocks come back in the order requests freed them, and
on a CPU decode attention over scattered blocks takes ~1.4x the time of neighbouring ones. Each round
cycles a fresh KV manager of each tree (the order alternating) with bench_peers' 64 mixed requests (the
scheduler and pool real, the model faked by a fixed token, so a cycle takes seconds), then decodes
bench_peers' long request (1,792 + 256 tokens) with the real model. A fresh pool (A's) is the reference:
its blocks lie end to end. Prints each decode rate's median, the paired A/B, and the long request's mean
run of neighbouring blocks; then, since an allocator that hands out neighbours may evict out of order,
the prefix cache's hit rate under each on a multi-turn chat load (a shared system prompt, 48
conversations of 6 turns, 16 at once, a pool that cannot hold them all).

    git worktree add /tmp/base <commit>
    .venv/bin/python benchmarks/bench_kv_layout.py --against /tmp/base
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import random
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

sys.path.insert(0, str(Path(__file__).parent))
from peers.workloads import Scale, make_workloads  # noqa: E402

from tritonllm.default_model import model_path_or_default  # noqa: E402
from tritonllm.engine.config import EngineConfig  # noqa: E402
from tritonllm.engine.llm_engine import LLMEngine  # noqa: E402
from tritonllm.engine.sampling_params import SamplingParams  # noqa: E402
from tritonllm.model.cpu_kernels import cpu_flags  # noqa: E402

FAKE_TOKEN = 1000


def other_kv_module(tree: Path) -> ModuleType:
    """`tritonllm.engine.kv_cache_manager` of another tree, over that tree's `block_pool`."""
    engine = tree / "src" / "tritonllm" / "engine"
    names = [f"tritonllm.engine.{name}" for name in ("block_pool", "kv_cache_manager")]
    saved = {name: sys.modules[name] for name in names}
    try:
        for name in names:  # the manager imports the pool by name: the other tree's, while loading
            spec = importlib.util.spec_from_file_location(name, engine / f"{name.rsplit('.', 1)[1]}.py")
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            spec.loader.exec_module(module)
        return module
    finally:
        sys.modules.update(saved)


def fresh_manager(engine: LLMEngine, module: ModuleType) -> None:
    """A new, empty KV manager of `module`'s class, swapped into the engine and its scheduler."""
    config = engine.config
    engine.kv = engine.scheduler.kv = module.KVCacheManager(
        engine.runner.num_blocks, config.tokens_per_block, config.enable_prefix_caching
    )


@contextlib.contextmanager
def model_faked(engine: LLMEngine) -> Iterator[None]:
    """Steps that sample FAKE_TOKEN without a forward pass: the scheduler and pool run alone, in seconds."""
    real = engine.runner.execute
    engine.runner.execute = lambda step, tables: [(c, FAKE_TOKEN, 0.0) for c in step.chunks if c.samples]
    try:
        yield
    finally:
        engine.runner.execute = real


def run_faked(engine: LLMEngine, requests: list[tuple[list[int], int]], tag: str) -> None:
    """Run `requests` (prompt, output length) to the end, the model faked."""
    with model_faked(engine):
        for i, (prompt, out) in enumerate(requests):
            engine.add_request(
                f"{tag}-{i}", prompt, SamplingParams(max_tokens=out, ignore_eos=True, temperature=0)
            )
        while engine.has_unfinished():
            engine.step()


def long_decode(engine: LLMEngine, prompt: list[int], out: int, tag: str) -> tuple[float, float]:
    """The real model on one long request: (decode tok/s, mean run of neighbouring blocks in its table)."""
    engine.add_request(tag, prompt, SamplingParams(max_tokens=out, ignore_eos=True, temperature=0))
    steps, table = [], []
    while engine.has_unfinished():
        started = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - started)
        table = engine.kv.block_table(tag) or table
    breaks = sum(b != a + 1 for a, b in zip(table, table[1:], strict=False))
    return (out - 1) / sum(steps[-(out - 1) :]), len(table) / (breaks + 1)


def chat_hit_rate(engine: LLMEngine, seed: int) -> float:
    """Prefix-cache hits over prompt tokens on a multi-turn chat load (the model faked)."""
    rng = random.Random(seed)
    system = [rng.randrange(2000, 40000) for _ in range(200)]
    history = [list(system) for _ in range(48)]
    turns = [0] * 48
    active: dict[str, int] = {}

    def start_turn(n: int) -> None:
        idle = [c for c in range(48) if c not in active.values() and turns[c] < 6]
        if idle:
            c = rng.choice(idle)
            history[c] += [rng.randrange(2000, 40000) for _ in range(rng.randrange(30, 200))]
            out = rng.randrange(30, 300)
            engine.add_request(
                f"chat-{n}", list(history[c]), SamplingParams(max_tokens=out, ignore_eos=True, temperature=0)
            )
            active[f"chat-{n}"] = c
            history[c] += [FAKE_TOKEN] * out
            turns[c] += 1

    with model_faked(engine):
        sent = 0
        for _ in range(16):
            start_turn(sent)
            sent += 1
        while engine.has_unfinished():
            for output in engine.step():
                if output.finished:
                    del active[output.request_id]
                    start_turn(sent)
                    sent += 1
    return engine.kv.prefix_hit_tokens / engine.kv.prefix_queried_tokens


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--against", required=True, type=Path, help="the other tree (a git worktree)")
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    parser.add_argument(
        "--num-kv-blocks", type=int, default=1024, help="16,384 tokens: the mixed load cycles it"
    )
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    engine = LLMEngine(
        EngineConfig(
            model=str(model_path_or_default(args.model)),
            dtype="auto",
            quantization="auto",
            num_kv_blocks=args.num_kv_blocks,
        )
    )
    modules = {"A": sys.modules["tritonllm.engine.kv_cache_manager"], "B": other_kv_module(args.against)}
    workloads = make_workloads(engine.vocab_size, 0, Scale())
    mixed = [(list(r.prompt_ids), r.max_tokens) for r in workloads["mixed"].requests]
    longs = [(list(r.prompt_ids), r.max_tokens) for r in workloads["long"].requests]
    rates: dict[str, list[float]] = {"A": [], "B": [], "fresh": []}
    runs: dict[str, list[float]] = {"A": [], "B": [], "fresh": []}
    for r in range(args.rounds):
        prompt, out = longs[r % len(longs)]
        for name in ("A", "B", "fresh") if r % 2 == 0 else ("B", "A", "fresh"):
            fresh_manager(engine, modules["A" if name == "fresh" else name])
            if name != "fresh":
                run_faked(engine, mixed, f"mixed-{r}-{name}")
            rate, run = long_decode(engine, prompt, out, f"long-{r}-{name}")
            rates[name].append(rate)
            runs[name].append(run)
        print(
            f"round {r + 1}/{args.rounds}: "
            + ", ".join(f"{n} {rates[n][-1]:.1f} tok/s (runs {runs[n][-1]:.1f})" for n in rates),
            flush=True,
        )
    hits = {}
    for name in ("A", "B"):
        fresh_manager(engine, modules[name])
        hits[name] = chat_hit_rate(engine, seed=1)
    paired = [a / b for a, b in zip(rates["A"], rates["B"], strict=True)]
    block = engine.config.tokens_per_block
    print(f"CPU flags: {' '.join(cpu_flags())}; pool {args.num_kv_blocks} blocks of {block} tokens")
    for name, title in (
        ("fresh", "fresh pool"),
        ("A", "cycled, this tree"),
        ("B", f"cycled, {args.against}"),
    ):
        rate, run = statistics.median(rates[name]), statistics.median(runs[name])
        print(f"{title}: long decode {rate:.1f} tok/s, mean run of neighbouring blocks {run:.1f}")
    print(f"A/B paired median {statistics.median(paired):.3f} ({min(paired):.2f}-{max(paired):.2f}); "
          f"A/fresh {statistics.median(rates['A']) / statistics.median(rates['fresh']):.3f}")  # fmt: skip
    print(f"chat prefix hit rate: A {hits['A']:.1%}, B {hits['B']:.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
