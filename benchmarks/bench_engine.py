"""Benchmark the paged-KV engine against naive HF transformers static batching, side by side.

One invocation measures, on SmolLM2-135M-Instruct with a fixed number of CPU threads:

1. output tokens/s: HF ``generate()`` in static batches vs the engine (continuous batching), same requests;
2. time to first token p50/p95 for both (everything submitted at t=0);
3. KV-cache utilisation of the engine's paged cache vs a contiguous max-length preallocation;
4. batch-1 decode tokens/s against the memory-bandwidth roofline (bandwidth measured here);
5. the same for the weight-only quantizations, a short throughput run each, and their accuracy against
   the unquantized engine (greedy token agreement, perplexity on a bundled text).

Results go to ``<out>/bench_engine[_quick].json`` and ``.png``; per-step and per-request data to
``<out>/raw/``. See benchmarks/README.md for how to read them. The parts live in ``engine_bench/``.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
from engine_bench.accuracy import measure_accuracy, token_agreement
from engine_bench.batch1 import batch1_results, decode_runs
from engine_bench.hf_baseline import run_baseline
from engine_bench.machine import CpuLoad, cpu_load, log, machine_info, measure_bandwidth
from engine_bench.report import Report, write_report
from engine_bench.throughput import ENGINE_SETTINGS, build_engine, run_engine
from engine_bench.workload import CORPUS, PERPLEXITY_TEXT, PromptSource, greedy, make_requests

from tritonllm.default_model import default_model_path

BENCH_NAME = "bench_engine"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="16 short requests, fewer repeats: a sanity run")
    p.add_argument("--skip-hf", action="store_true", help="skip the HF transformers baseline")
    p.add_argument(
        "--quantizations",
        default="none,int8,bfloat16:none,bfloat16:int8,int8_wo,fp8",
        help="comma-separated engines: a quantization, or dtype:quantization (default dtype float32); "
        "'none' (float32) always runs: it is the accuracy reference",
    )
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    p.add_argument("--model", type=Path, default=None, help="HF folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hf-batch-size", type=int, default=16)
    p.add_argument("--kv-cache-gib", type=float, default=None, help="KV pool per engine (2, quick: 0.25)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    quants = ["none"] + [q for q in args.quantizations.split(",") if q and q != "none"]
    if args.quick:
        num_requests, prompt_range, output_range = 16, (32, 128), (16, 64)
        quant_requests, batch1_runs, accuracy_prompts, batch1_budget_s = 8, 3, 2, 10.0
    else:
        num_requests, prompt_range, output_range = 64, (32, 512), (16, 256)
        quant_requests, batch1_runs, accuracy_prompts, batch1_budget_s = 16, 5, 4, 30.0
    batch1_prompt, batch1_output, accuracy_tokens = 128, 128, 64
    quant_output_range = (16, 64)  # short: fp8 dequantizes every weight every step and is slow
    kv_bytes = int((args.kv_cache_gib or (0.25 if args.quick else 2.0)) * 2**30)
    max_model_len = prompt_range[1] + output_range[1]
    settings = {
        "num_requests": num_requests,
        "prompt_tokens_range": prompt_range,
        "output_tokens_range": output_range,
        "hf_batch_size": args.hf_batch_size,
        "quant_throughput_requests": quant_requests,
        "batch1_prompt_tokens": batch1_prompt,
        "batch1_output_tokens": batch1_output,
        "batch1_runs": batch1_runs,
        "batch1_decode_budget_s_per_run": batch1_budget_s,
        "quant_throughput_output_range": quant_output_range,
        "accuracy_prompts": accuracy_prompts,
        "accuracy_tokens": accuracy_tokens,
        "seed": args.seed,
        "engine": {"dtype": "float32", **ENGINE_SETTINGS, "kv_cache_memory_bytes": kv_bytes},
        "quantizations": quants,
    }
    torch.set_num_threads(args.threads)
    model_path = args.model or default_model_path()
    out_dir: Path = args.out
    (out_dir / "raw").mkdir(parents=True, exist_ok=True)
    stem = BENCH_NAME + ("_quick" if args.quick else "")

    machine = machine_info(args.threads)
    loads: list[CpuLoad] = []

    def phase_done(name: str) -> None:
        load = cpu_load(name)
        loads.append(load)
        if load.loadavg_1m > (os.cpu_count() or 1) + 0.5:
            log(
                f"WARNING: load average {load.loadavg_1m:.1f} on {os.cpu_count()} CPUs during '{name}': "
                "other processes share these cores, timings are inflated"
            )

    log(f"{machine.cpu_model}, {args.threads} threads, torch {machine.torch_version}; model {model_path}")
    bandwidth = measure_bandwidth()
    phase_done("bandwidth")
    log(
        f"bandwidth: copy {bandwidth.best_copy_gbps:.1f} GB/s, sum {bandwidth.best_sum_gbps:.1f} GB/s "
        f"(best of {len(bandwidth.copy_gbps_runs)}); roofline uses {bandwidth.roofline_method}"
    )

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    corpus_ids = tokenizer("\n\n".join(CORPUS))["input_ids"]
    ppl_ids = tokenizer(PERPLEXITY_TEXT)["input_ids"]
    source = PromptSource(corpus_ids, args.seed)
    requests = make_requests(source, "req", num_requests, prompt_range, output_range, args.seed)
    quant_reqs = make_requests(source, "q", quant_requests, prompt_range, quant_output_range, args.seed + 1)
    log(
        f"{num_requests} requests: {sum(len(r.prompt) for r in requests)} prompt tokens, "
        f"{sum(r.max_tokens for r in requests)} output tokens; corpus {len(corpus_ids)} tokens, "
        f"perplexity text {len(ppl_ids)} tokens"
    )

    hf_result, hf_outputs, hf_ppl = None, None, None
    if not args.skip_hf:
        hf_result, hf_outputs, hf_ppl = run_baseline(
            model_path, tokenizer, source, requests, args.hf_batch_size, ppl_ids, phase_done
        )

    log(f"building engines: {', '.join(quants)}")
    engines = {q: build_engine(model_path, q, args.threads, kv_bytes) for q in quants}
    for eng in engines.values():  # warm-up: one short batch per engine
        eng.generate([source.take(64), source.take(48)], greedy(8))

    log("engine throughput run (none)")
    engine_result, engine_outputs, kv_util, samples = run_engine(
        engines["none"], requests, "engine", max_model_len
    )
    phase_done("engine")
    log(
        f"engine: {engine_result.output_tokens_per_s:.1f} tok/s, wall {engine_result.wall_s:.1f} s, TTFT p50 "
        f"{engine_result.ttft_p50_s:.2f} s p95 {engine_result.ttft_p95_s:.2f} s, "
        f"{engine_result.num_preemptions} preemptions; KV paged {kv_util.paged_time_avg:.1%} vs contiguous "
        f"{kv_util.contiguous_time_avg:.1%}"
    )
    speedup = hf_result and engine_result.output_tokens_per_s / hf_result.output_tokens_per_s
    hf_agreement = None
    if hf_outputs is not None:
        ids = [r.request_id for r in requests]
        hf_agreement = token_agreement([hf_outputs[i] for i in ids], [engine_outputs[i] for i in ids])[1]

    rates, step_times = decode_runs(
        engines, source, batch1_runs, batch1_prompt, batch1_output, batch1_budget_s
    )
    phase_done("batch1")
    batch1 = batch1_results(engines, rates, step_times, bandwidth, batch1_prompt, batch1_output)

    log(f"quantization throughput: {quant_requests} requests per engine")
    quant_throughput = []
    for q, eng in engines.items():
        result, _, _, _ = run_engine(eng, quant_reqs, f"engine_{q}", max_model_len)
        quant_throughput.append(result)
        phase_done(f"quant_throughput_{q}")
        log(f"  {q}: {result.output_tokens_per_s:.1f} tok/s, wall {result.wall_s:.1f} s")

    log(
        f"accuracy: {accuracy_prompts} prompts x {accuracy_tokens} tokens, "
        f"perplexity on {len(ppl_ids)} tokens"
    )
    prompts = [source.take(64) for _ in range(accuracy_prompts)]
    accuracy = measure_accuracy(engines, prompts, accuracy_tokens, ppl_ids)
    phase_done("accuracy")
    if hf_ppl is not None:
        log(f"  HF transformers perplexity (reference for 'none'): {hf_ppl:.4f}")

    report = Report(
        benchmark=BENCH_NAME,
        quick=args.quick,
        model=str(model_path),
        machine=machine,
        settings=settings,
        bandwidth=bandwidth,
        hf=hf_result,
        engine=engine_result,
        speedup_vs_hf=speedup,
        hf_engine_token_agreement=hf_agreement,
        kv_util=kv_util,
        batch1=batch1,
        quant_throughput=quant_throughput,
        accuracy=accuracy,
        hf_perplexity=hf_ppl,
        targets={"speedup_vs_hf": 3.0, "kv_paged_utilisation": 0.9, "batch1_pct_of_roofline": 0.7},
        cpu_load=loads,
    )
    write_report(report, samples, requests, step_times, out_dir, stem)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
