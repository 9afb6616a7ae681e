"""Where a decode step's time goes, op by op, against what this machine's memory streams.

Batch-1 decode reads every weight once a token, so its floor is the weights' bytes over the memory
bandwidth. This runs the engine (the serving default: int8 weights where the kernels build) on greedy
requests and, every `--every`-th step, replaces the fused layer loop (`decode_layers`, one C++ call) by the
same kernels called one by one from Python on the same tensors (same results), timing each op. Prints,
per step: each op's time summed over the layers (an empty kernel call's cost, the Python overhead in each
timed op, shown beside), the linears' and the lm_head's effective GB/s, the fused loop's own time, the rest
of the step, and the bandwidth of one long read with the engine's threads (a float sum over 256 MB): the
gap between those GB/s figures is what per-op costs (parallel regions, streams restarting at each weight)
take from batch-1 decode. Not a timed test: medians over steps, on a machine that drifts.

    .venv/bin/python benchmarks/bench_decode_anatomy.py [--batch 1] [--steps 200] [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).parent))
from bench_serving_paths import add_engine_arguments  # noqa: E402

from tritonllm.default_model import model_path_or_default  # noqa: E402
from tritonllm.engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from tritonllm.model import llama  # noqa: E402
from tritonllm.model.cpu_kernels import cpu_flags, load_kernels, selected_isa  # noqa: E402

OPS = ("norm", "qkv", "rope", "attention", "o", "gate_up", "silu", "down")
LINEARS = ("qkv", "o", "gate_up", "down")


class Anatomy:
    """Stands in for the kernels module inside the model: every call goes to the real module, except that
    `decode_layers` runs op by op (timed) on the steps `timing` marks, and is timed whole on the others.
    The first op-by-op step also runs the fused call on copies and records whether the two agree to the
    bit. The linears run the bindings their modules hold (`kernel_linear`)."""

    def __init__(self, kernels, linears: list[tuple[torch.nn.Module, ...]]):
        self.kernels = kernels
        self.linears = linears  # per layer: qkv, o, gate_up, down
        self.timing = False
        self.ops: dict[str, list[float]] = defaultdict(list)
        self.fused_us: list[float] = []
        self.same_bits: bool | None = None

    def __getattr__(self, name):
        return getattr(self.kernels, name)

    def decode_layers(self, x, layers, *rest):
        if not self.timing:
            started = time.perf_counter()
            out = self.kernels.decode_layers(x, layers, *rest)
            self.fused_us.append((time.perf_counter() - started) * 1e6)
            return out
        if self.same_bits is None:  # the caches get the same rows twice: the same values at the same slots
            x_fused = x.clone()
            fused = self.kernels.decode_layers(x_fused, layers, *rest)
            out = self.op_by_op(x, layers, *rest)
            self.same_bits = torch.equal(out, fused) and torch.equal(x, x_fused)
            return out
        return self.op_by_op(x, layers, *rest)

    def op_by_op(self, x, layers, cos, sin, slots, k_caches, v_caches, tables, lens, eps, heads, scale):
        """decode_stack.cpp's loop through the separate bindings, each op timed."""
        k = self.kernels
        spent = dict.fromkeys(OPS, 0.0)

        def timed(op: str, fn, *args):
            started = time.perf_counter()
            result = fn(*args)
            spent[op] += time.perf_counter() - started
            return result

        def linear(op: str, module, x):
            # The binding itself, as decode_stack.cpp's run_linear calls it: the module's Python around it
            # (~5 us a call) would be counted as the op's.
            return timed(op, module.kernel_linear, x, module.weight, module.bias)

        delta = None
        for i, layer in enumerate(layers):
            norm1, norm2 = layer[:2]
            qkv_proj, o_proj, gate_up_proj, down_proj = self.linears[i]
            normed = timed("norm", k.add_rms_norm, x, delta, norm1, eps)
            qkv = linear("qkv", qkv_proj, normed)
            qk = timed("rope", k.rope_and_cache, qkv, cos, sin, slots, k_caches[i], v_caches[i], heads)
            q = qk[:, :heads].contiguous()
            attended = timed(
                "attention", k.paged_decode_attention, q, k_caches[i], v_caches[i], tables, lens, scale
            )
            projected = linear("o", o_proj, attended.view(x.size(0), -1))
            normed = timed("norm", k.add_rms_norm, x, projected, norm2, eps)
            gate_up = linear("gate_up", gate_up_proj, normed)
            activated = timed("silu", k.silu_and_mul, gate_up)
            delta = linear("down", down_proj, activated)
        for op, seconds in spent.items():
            self.ops[op].append(seconds * 1e6)
        return delta


def stream_gb_s(nbytes: int = 256 << 20, runs: int = 15) -> float:
    """GB/s of the best of `runs` float sums over `nbytes` with the engine's threads: one long read."""
    data = torch.ones(nbytes // 4)
    best = min(timed_s(data.sum) for _ in range(runs))
    return nbytes / best / 1e9


def timed_s(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def timed_forward(module: torch.nn.Module, times_us: list[float]) -> None:
    """Append each forward call's microseconds to `times_us`."""
    forward = module.forward

    def timed(*args):
        started = time.perf_counter()
        out = forward(*args)
        times_us.append((time.perf_counter() - started) * 1e6)
        return out

    module.forward = timed


def report(anatomy: Anatomy, model, head_us: list[float], step_us: list[float], call_us: float) -> None:
    layers = model.packed_layers
    weight_bytes = {
        op: sum(layer[2 + 2 * j].numel() * layer[2 + 2 * j].element_size() for layer in layers)
        for j, op in enumerate(LINEARS)
    }
    head = model.lm_head
    head_bytes = sum(t.numel() * t.element_size() for t in [*head.parameters(), *head.buffers()])
    med = {op: statistics.median(v) for op, v in anatomy.ops.items()}
    fused, head_med, step = (statistics.median(v) for v in (anatomy.fused_us, head_us, step_us))
    print(f"{'op':<10} {'us a step':>10} {'GB/s':>6}   (GB/s: the weights' bytes over the time)")
    for op in OPS:
        rate = f"{weight_bytes[op] / med[op] / 1e3:6.1f}" if op in weight_bytes else ""
        print(f"{op:<10} {med[op]:10.1f} {rate}")
    linear_us = sum(med[op] for op in LINEARS)
    calls = (len(OPS) + 1) * len(layers)  # two norms a layer
    print(f"linears    {linear_us:10.1f} {sum(weight_bytes.values()) / linear_us / 1e3:6.1f}")
    print(f"op by op   {sum(med.values()):10.1f}   ({calls} calls; an empty one takes {call_us:.1f} us)")
    print(
        f"fused      {fused:10.1f}   (decode_layers: the same ops in one C++ call; to the bit the same: "
        f"{anatomy.same_bits})"
    )
    print(f"lm_head    {head_med:10.1f} {head_bytes / head_med / 1e3:6.1f}")
    rest = step - fused - head_med
    print(f"step       {step:10.1f}   (a fused step; outside the layers and the head: {rest:.1f})")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", help="HF checkpoint or engine directory (default: SmolLM2-135M-Instruct)")
    add_engine_arguments(parser)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--kv-cache-dtype", default="auto", help="as EngineConfig's (default: auto)")
    parser.add_argument("--steps", type=int, default=200, help="decode steps timed op by op")
    parser.add_argument(
        "--every", type=int, default=2, help="time every N-th step op by op, the others fused"
    )
    args = parser.parse_args()
    model_path = model_path_or_default(args.model)
    config = EngineConfig(
        model=model_path,
        num_threads=args.threads,
        dtype=args.dtype,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    engine = LLMEngine(config)
    kernels = load_kernels()
    if kernels is None:
        print("no CPU kernels on this machine: nothing to take apart")
        return 1
    model = engine.runner.model
    anatomy = Anatomy(kernels, [layer.linears for layer in model.layers])
    llama.load_kernels = lambda *_: anatomy
    if not model.packed_layers:
        print("this model's linears do not all run on the kernels: steps take the Python layer loop")
        return 1
    head_us: list[float] = []
    timed_forward(model.lm_head, head_us)
    rng = np.random.default_rng(0)
    length = args.steps * args.every + 32  # every request decodes through all the timed steps
    params = SamplingParams(max_tokens=length, min_tokens=length, top_k=1)
    for i in range(args.batch):
        engine.add_request(f"r{i}", rng.integers(100, 20000, size=args.prompt_tokens).tolist(), params)
    while engine.stats().num_waiting:
        engine.step()
    for _ in range(8):  # the last prefill chunks done, the first decode steps warm
        engine.step()
    anatomy.fused_us.clear()
    head_us.clear()
    step_us = []
    for n in range(args.steps * args.every):
        anatomy.timing = n % args.every == 0
        started = time.perf_counter()
        engine.step()
        if not anatomy.timing:
            step_us.append((time.perf_counter() - started) * 1e6)
    empty = torch.zeros(1, 2)
    call_us = statistics.median(timed_s(lambda: kernels.silu_and_mul(empty)) for _ in range(2000)) * 1e6
    threads = torch.get_num_threads()
    print(f"CPU flags: {' '.join(cpu_flags())}; kernels: {selected_isa()} build; {threads} threads; "
          f"load average {os.getloadavg()}")  # fmt: skip
    print(f"{config.model} ({config.quantization} weights, {config.kv_cache_dtype} KV cache): batch "
          f"{args.batch}, prompts of {args.prompt_tokens} tokens; medians of {args.steps} steps")  # fmt: skip
    report(anatomy, model, head_us, step_us, call_us)
    print(f"one long read with {threads} threads: {stream_gb_s():.1f} GB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
