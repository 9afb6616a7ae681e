"""Benchmark the paged-KV engine against naive HF transformers static batching, side by side.

One invocation measures, on SmolLM2-135M-Instruct with a fixed number of CPU threads:

1. output tokens/s: HF ``generate()`` in static batches vs the engine (continuous batching), same requests;
2. time to first token p50/p95 for both (everything submitted at t=0);
3. KV-cache utilisation of the engine's paged cache vs a contiguous max-length preallocation;
4. batch-1 decode tokens/s against the memory-bandwidth roofline (bandwidth measured here);
5. the same for the weight-only quantizations, a short throughput run each, and their accuracy against
   the unquantized engine (greedy token agreement, perplexity on a bundled text).

Results go to ``<out>/bench_engine[_quick].json`` and ``.png``; per-step and per-request data to
``<out>/raw/``. See benchmarks/README.md for how to read them.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from tritonllm.default_model import default_model_path
from tritonllm.engine import EngineConfig, LLMEngine, SamplingParams
from tritonllm.engine.evaluate import perplexity

BENCH_NAME = "bench_engine"

# Prompts are cut from this text (cyclically, from a different offset per request).
CORPUS = [
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a can of oil and a "
    "rag that had once been a shirt. For thirty years he had trimmed the wick, polished the great lens, "
    "and written the state of the sea in a leather logbook. Ships passed without knowing his name, and he "
    "liked it that way; the light was the only thing that needed to be seen.",
    "Bread is one of the oldest prepared foods. Flour, water, salt and a little yeast are mixed into a "
    "dough, which is kneaded until the gluten forms long elastic strands. The dough rises as the yeast "
    "ferments sugars and releases carbon dioxide, and the trapped gas gives the loaf its open crumb. "
    "Baking sets the structure, browns the crust and drives off most of the alcohol.",
    "In the early days of computing, programs were entered by flipping switches or feeding punched cards "
    "into a reader. A single mistake meant waiting hours for another turn on the machine. Assemblers, "
    "then compilers, let programmers write instructions in a more human form, and time-sharing systems "
    "allowed many people to use the same computer at once from separate terminals.",
    "Rivers shape the land they cross. Over thousands of years, water carries sand and gravel downstream, "
    "cutting valleys in the hills and building wide plains where the current slows. When a river floods, "
    "it spreads fine silt across the fields, which is why so many farming villages grew up along its "
    "banks despite the risk of losing a harvest to high water.",
    "The committee met on a Tuesday to review the budget for the new library. The architect presented "
    "three designs: a glass pavilion, a brick building that matched the old town hall, and a timber "
    "structure with a garden on the roof. After two hours of discussion, the members agreed to ask the "
    "public for comments before making a final decision next month.",
    "Honeybees communicate the location of flowers through a waggle dance performed inside the hive. The "
    "angle of the dance relative to vertical tells the other bees the direction of the food compared "
    "with the sun, while the length of the waggle run encodes the distance. A strong colony can gather "
    "nectar from fields several kilometres away using this simple language.",
    "She packed light for the journey: two shirts, a notebook, a map folded so many times that the creases "
    "had worn through, and a small camera that belonged to her grandmother. The train left before sunrise. "
    "By noon the city had given way to pine forests and lakes so still that the clouds seemed to sit on "
    "the water, and she stopped counting the stations.",
    "A good experiment begins with a clear question and a way to measure the answer. Scientists change one "
    "variable at a time, keep the others fixed, and repeat the measurement to estimate how much the result "
    "varies by chance. Publishing the method in enough detail lets other laboratories try to reproduce the "
    "finding, which is how a surprising claim slowly becomes accepted knowledge.",
]

# Perplexity text (~400 tokens), not part of the prompts.
PERPLEXITY_TEXT = (
    "The old market opened at six in the morning, long before most of the town was awake. Farmers arrived "
    "in small trucks loaded with crates of tomatoes, onions, apples and fresh herbs, and set up their "
    "stalls under striped canvas awnings. The fishmonger laid his catch on beds of crushed ice, and the "
    "baker at the corner pulled the first trays of rolls from the oven, filling the square with the smell "
    "of warm bread.\n\n"
    "By eight o'clock the square was crowded. Parents with children, students on their way to school, and "
    "retired couples moved slowly between the stalls, comparing prices and chatting with the sellers they "
    "had known for years. Some people came only for coffee and conversation; others carried long lists and "
    "left with heavy bags. The market was as much a meeting place as a place to shop.\n\n"
    "In recent years, the town council has debated whether to move the market to a larger covered hall on "
    "the edge of town. Supporters argue that the new site would offer parking, shelter from the rain and "
    "better facilities for the traders. Opponents worry that the move would empty the historic centre, "
    "hurt the small cafes and shops around the square, and break a tradition that has lasted for more than "
    "two hundred years.\n\n"
    "For now, nothing has changed. Every Saturday the awnings go up again, the trucks line the narrow "
    "streets, and the sound of bargaining echoes off the stone walls. When the church bell rings at noon, "
    "the traders begin to pack away what they have not sold, and by one o'clock the square is quiet, "
    "swept clean, and waiting for the next week."
)


# --------------------------------------------------------------------------------------------- results


@dataclass
class MachineInfo:
    cpu_model: str
    logical_cpus: int
    threads: int
    memory_gib: float
    torch_version: str
    transformers_version: str
    python_version: str
    platform: str
    git_commit: str
    timestamp: str


@dataclass
class BandwidthResult:
    buffer_mib: int
    copy_gbps_runs: list[float]  # (read + write bytes) / time of dst.copy_(src)
    sum_gbps_runs: list[float]  # read bytes / time of src.sum()
    best_copy_gbps: float
    best_sum_gbps: float
    roofline_gbps: float  # the best over both methods
    roofline_method: str


@dataclass
class ThroughputResult:
    name: str
    num_requests: int
    useful_output_tokens: int  # tokens the requests asked for
    computed_output_tokens: int  # tokens actually generated (HF: padded to the batch's longest)
    prompt_tokens: int
    wall_s: float
    output_tokens_per_s: float
    ttft_p50_s: float
    ttft_p95_s: float
    ttft_s: list[float]
    num_preemptions: int = 0
    extra: dict = field(default_factory=dict)

    @classmethod
    def measured(
        cls, name: str, requests: list, computed: int, wall: float, ttft: list[float], **fields
    ) -> ThroughputResult:
        """Derive the rates and percentiles from one run's raw figures."""
        useful = sum(r.max_tokens for r in requests)
        return cls(
            name=name,
            num_requests=len(requests),
            useful_output_tokens=useful,
            computed_output_tokens=computed,
            prompt_tokens=sum(len(r.prompt) for r in requests),
            wall_s=wall,
            output_tokens_per_s=useful / wall,
            ttft_p50_s=percentile(ttft, 50),
            ttft_p95_s=percentile(ttft, 95),
            ttft_s=ttft,
            **fields,
        )


@dataclass
class KVUtilResult:
    paged_time_avg: float  # kv_tokens_stored / (kv_blocks_used * tokens_per_block), step-time weighted
    contiguous_time_avg: float  # kv_tokens_stored / (num_running * max_model_len), step-time weighted
    paged_min: float
    max_model_len: int
    tokens_per_block: int
    num_steps: int
    peak_blocks_used: int
    kv_blocks_total: int


@dataclass
class Batch1Result:
    quantization: str
    prompt_tokens: int
    output_tokens: int
    decode_tokens_per_s_runs: list[float]
    decode_steps_timed: int  # over all runs; below runs x (output_tokens - 1) when cut off by the budget
    decode_tokens_per_s: float  # median over runs
    median_step_ms: float
    weight_bytes: int  # parameters + buffers (tied tensors once, inv_freq excluded)
    streamed_bytes: int  # weight_bytes minus an embedding table that is only gathered from
    roofline_tokens_per_s: float  # bandwidth / weight_bytes
    pct_of_roofline: float
    streamed_roofline_tokens_per_s: float  # bandwidth / streamed_bytes
    pct_of_streamed_roofline: float


@dataclass
class AccuracyResult:
    quantization: str
    num_prompts: int
    tokens_per_prompt: int
    agreement_before_divergence: float  # mean over prompts of (identical prefix length / tokens)
    agreement_overall: float  # identical positions / all positions
    perplexity: float
    perplexity_tokens: int


@dataclass
class CpuLoad:
    """Machine load when a phase ended: other processes on these cores distort every timing."""

    phase: str
    loadavg_1m: float
    cpu_pressure_avg10: float | None  # % of time some runnable task waited for a CPU (Linux PSI)


@dataclass
class Report:
    benchmark: str
    quick: bool
    model: str
    machine: MachineInfo
    settings: dict
    bandwidth: BandwidthResult
    hf: ThroughputResult | None
    engine: ThroughputResult
    speedup_vs_hf: float | None
    hf_engine_token_agreement: float | None
    kv_util: KVUtilResult
    batch1: list[Batch1Result]
    quant_throughput: list[ThroughputResult]
    accuracy: list[AccuracyResult]
    hf_perplexity: float | None
    targets: dict
    cpu_load: list[CpuLoad]


# --------------------------------------------------------------------------------------------- helpers


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile, q in [0, 100]."""
    if not values:
        return float("nan")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def cpu_load(phase: str) -> CpuLoad:
    try:
        load = float(Path("/proc/loadavg").read_text().split()[0])
    except (OSError, ValueError):
        load = float("nan")
    try:
        some = Path("/proc/pressure/cpu").read_text().splitlines()[0]
        pressure = float(some.split()[1].split("=")[1])
    except (OSError, ValueError, IndexError):
        pressure = None
    return CpuLoad(phase, load, pressure)


def machine_info(threads: int) -> MachineInfo:
    import transformers

    cpu = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        mem_kib = next(
            int(line.split()[1])
            for line in Path("/proc/meminfo").read_text().splitlines()
            if line.startswith("MemTotal")
        )
    except (OSError, StopIteration):
        mem_kib = 0
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            cwd=Path(__file__).parent,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    return MachineInfo(
        cpu_model=cpu,
        logical_cpus=os.cpu_count() or 0,
        threads=threads,
        memory_gib=round(mem_kib / 2**20, 1),
        torch_version=torch.__version__,
        transformers_version=transformers.__version__,
        python_version=platform.python_version(),
        platform=platform.platform(),
        git_commit=commit,
        timestamp=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    )


def measure_bandwidth(buffer_mib: int = 512, runs: int = 7) -> BandwidthResult:
    """Best-of-N memory bandwidth with the benchmark's threads: a large copy and a large sum."""
    n = buffer_mib * 2**20 // 4
    src = torch.ones(n, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)  # touch both buffers once
    copy, total = [], []
    for _ in range(runs):
        t = time.perf_counter()
        dst.copy_(src)
        copy.append(2 * src.nbytes / (time.perf_counter() - t) / 1e9)
        t = time.perf_counter()
        src.sum()
        total.append(src.nbytes / (time.perf_counter() - t) / 1e9)
    best_copy, best_sum = max(copy), max(total)
    method = "sum (read only)" if best_sum >= best_copy else "copy (read + write bytes)"
    return BandwidthResult(buffer_mib, copy, total, best_copy, best_sum, max(best_copy, best_sum), method)


# --------------------------------------------------------------------------------------------- workload


@dataclass
class Request:
    request_id: str
    prompt: list[int]
    max_tokens: int


class PromptSource:
    """Prompts cut cyclically from the tokenized corpus, each starting at an offset not used before."""

    def __init__(self, token_ids: list[int], seed: int):
        self.ids = token_ids
        self.offsets = list(range(len(token_ids)))
        random.Random(seed).shuffle(self.offsets)

    def take(self, length: int) -> list[int]:
        if not self.offsets:
            raise RuntimeError("out of distinct prompt offsets: lengthen CORPUS")
        start = self.offsets.pop()
        return [self.ids[(start + i) % len(self.ids)] for i in range(length)]


def make_requests(
    source: PromptSource,
    prefix: str,
    n: int,
    prompt_range: tuple[int, int],
    output_range: tuple[int, int],
    seed: int,
) -> list[Request]:
    rng = random.Random(seed)
    requests = []
    for i in range(n):
        prompt_len, max_tokens = rng.randint(*prompt_range), rng.randint(*output_range)
        requests.append(Request(f"{prefix}-{i}", source.take(prompt_len), max_tokens))
    return requests


# --------------------------------------------------------------------------------------------- HF baseline


class FirstTokenTimer:
    """A generate() streamer: the first put() is the prompt, the second the first generated tokens."""

    def __init__(self, progress: tqdm):
        self.calls = 0
        self.first_token_time: float | None = None
        self.progress = progress

    def put(self, value: torch.Tensor) -> None:
        self.calls += 1
        if self.calls == 2:
            self.first_token_time = time.perf_counter()
        if self.calls >= 2:
            self.progress.update(value.numel())

    def end(self) -> None:
        pass


def hf_generate_batch(model, batch: list[Request], pad_id: int, streamer=None) -> list[list[int]]:
    """Greedy, left-padded, running until the batch's longest request ends (EOS never stops it)."""
    width = max(len(r.prompt) for r in batch)
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, r in enumerate(batch):
        input_ids[row, width - len(r.prompt) :] = torch.tensor(r.prompt)
        mask[row, width - len(r.prompt) :] = 1
    steps = max(r.max_tokens for r in batch)
    out = model.generate(
        input_ids=input_ids,
        attention_mask=mask,
        max_new_tokens=steps,
        min_new_tokens=steps,
        do_sample=False,
        temperature=None,
        top_p=None,
        top_k=None,
        pad_token_id=pad_id,
        streamer=streamer,
    )
    return [out[row, width : width + r.max_tokens].tolist() for row, r in enumerate(batch)]


def run_hf(model, requests: list[Request], batch_size: int, pad_id: int) -> tuple[ThroughputResult, dict]:
    batches = [requests[i : i + batch_size] for i in range(0, len(requests), batch_size)]
    computed = sum(len(b) * max(r.max_tokens for r in b) for b in batches)
    outputs: dict[str, list[int]] = {}
    ttft: list[float] = []
    progress = tqdm(total=computed, desc="HF static batches", unit="tok", mininterval=5, file=sys.stdout)
    t0 = time.perf_counter()
    for batch in batches:
        timer = FirstTokenTimer(progress)
        tokens = hf_generate_batch(model, batch, pad_id, timer)
        ttft.extend([timer.first_token_time - t0] * len(batch))
        outputs.update({r.request_id: t for r, t in zip(batch, tokens, strict=True)})
    wall = time.perf_counter() - t0
    progress.close()
    useful = sum(r.max_tokens for r in requests)
    result = ThroughputResult.measured(
        "hf_static_batching",
        requests,
        computed,
        wall,
        ttft,
        extra={"batch_size": batch_size, "padded_waste_fraction": 1 - useful / computed},
    )
    return result, outputs


# --------------------------------------------------------------------------------------------- engine


def build_engine(model: Path, variant: str, threads: int, kv_bytes: int) -> LLMEngine:
    """`variant`: a quantization, or `dtype:quantization` (float32 when no dtype is given)."""
    dtype, _, quantization = variant.rpartition(":")
    return LLMEngine(
        EngineConfig(
            model=str(model),
            dtype=dtype or "float32",
            quantization=quantization,
            num_threads=threads,
            max_num_seqs=64,
            max_num_batched_tokens=512,
            kv_cache_memory_bytes=kv_bytes,
            tokens_per_block=16,
        )
    )


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


@dataclass
class KVSample:
    t: float  # seconds since submission, at the end of the step
    dt: float  # the step's duration
    stored: int
    reserved: int  # kv_blocks_used * tokens_per_block
    running: int


def run_engine(
    eng: LLMEngine, requests: list[Request], name: str, max_model_len: int, show_progress: bool = True
) -> tuple[ThroughputResult, dict, KVUtilResult, list[KVSample]]:
    """Submit everything at once and step to completion, sampling the KV cache after every step."""
    useful = sum(r.max_tokens for r in requests)
    outputs: dict[str, list[int]] = {r.request_id: [] for r in requests}
    first_token_ns: dict[str, int] = {}
    samples: list[KVSample] = []
    progress = tqdm(
        total=useful, desc=name, unit="tok", mininterval=5, file=sys.stdout, disable=not show_progress
    )
    preempt0 = eng.stats().num_preemptions
    submit_ns = time.time_ns()
    t0 = time.perf_counter()
    for r in requests:
        eng.add_request(r.request_id, r.prompt, greedy(r.max_tokens))
    while eng.has_unfinished():
        ts = time.perf_counter()
        outs = eng.step()
        te = time.perf_counter()
        st = eng.stats()
        samples.append(
            KVSample(
                te - t0, te - ts, st.kv_tokens_stored, st.kv_blocks_used * st.tokens_per_block, st.num_running
            )
        )
        for o in outs:
            if o.error:
                raise RuntimeError(f"request {o.request_id} failed: {o.error}")
            outputs[o.request_id].extend(o.new_token_ids)
            first_token_ns.setdefault(o.request_id, o.first_token_time_ns)
            progress.update(len(o.new_token_ids))
    wall = time.perf_counter() - t0
    progress.close()
    got = sum(len(v) for v in outputs.values())
    if got != useful:
        raise RuntimeError(f"{name}: engine produced {got} tokens, {useful} requested")
    ttft = [(first_token_ns[r.request_id] - submit_ns) / 1e9 for r in requests]
    st = eng.stats()
    result = ThroughputResult.measured(
        name,
        requests,
        got,
        wall,
        ttft,
        num_preemptions=st.num_preemptions - preempt0,
        extra={"num_steps": len(samples)},
    )
    return (
        result,
        outputs,
        kv_utilisation(samples, max_model_len, st.tokens_per_block, st.kv_blocks_total),
        samples,
    )


def kv_utilisation(
    samples: list[KVSample], max_model_len: int, tokens_per_block: int, total: int
) -> KVUtilResult:
    live = [s for s in samples if s.running and s.reserved]
    weight = sum(s.dt for s in live) or 1.0
    paged = [s.stored / s.reserved for s in live]
    contiguous = [s.stored / (s.running * max_model_len) for s in live]
    return KVUtilResult(
        paged_time_avg=sum(p * s.dt for p, s in zip(paged, live, strict=True)) / weight,
        contiguous_time_avg=sum(c * s.dt for c, s in zip(contiguous, live, strict=True)) / weight,
        paged_min=min(paged, default=float("nan")),
        max_model_len=max_model_len,
        tokens_per_block=tokens_per_block,
        num_steps=len(samples),
        peak_blocks_used=max((s.reserved // tokens_per_block for s in samples), default=0),
        kv_blocks_total=total,
    )


def storage_key(t: torch.Tensor) -> tuple[int, int]:
    """Identity of a tensor's memory; oneDNN-packed weights have no data pointer, so use the object."""
    return (id(t), -1) if t.is_mkldnn else (t.data_ptr(), t.numel())


def weight_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """(all parameter + buffer bytes, bytes a decode step streams), each tensor storage counted once.

    Tied embeddings appear as two Parameter objects over one storage, so tensors are deduplicated by
    storage address, not by object. The second figure leaves out an embedding table the lm_head does
    not share (e.g. under quantization): decode only gathers one row of it.
    """
    tensors = dict(model.named_parameters(remove_duplicate=True)) | dict(model.named_buffers())
    seen: dict[tuple[int, int], tuple[str, int]] = {}
    for name, t in tensors.items():
        if name.endswith("inv_freq"):
            continue
        seen.setdefault(storage_key(t), (name, t.numel() * t.element_size()))
    total = sum(size for _, size in seen.values())
    lm_head_keys = {storage_key(t) for t in [*model.lm_head.parameters(), *model.lm_head.buffers()]}
    embed = model.embed
    shared = storage_key(embed) in lm_head_keys
    streamed = total - (0 if shared else embed.numel() * embed.element_size())
    return total, streamed


def batch1_decode(
    eng: LLMEngine, prompt: list[int], output_tokens: int, rid: str, budget_s: float
) -> tuple[float, list[float]]:
    """Decode tokens/s of one request alone: the first step (prefill + first token) is left out.

    A slow engine is cut off after `budget_s` seconds of decoding (at least 8 decode steps): its
    per-step cost hardly depends on the context length at these sizes, so the rate stands.
    """
    eng.add_request(rid, prompt, greedy(output_tokens))
    steps = []
    while eng.has_unfinished():
        t = time.perf_counter()
        eng.step()
        steps.append(time.perf_counter() - t)
        if len(steps) > 8 and sum(steps[1:]) > budget_s:
            eng.abort(rid)
    decode = steps[1:]
    return len(decode) / sum(decode), decode


def logits_perplexity(logits: torch.Tensor, ids: list[int]) -> float:
    return math.exp(F.cross_entropy(logits[:-1].float(), torch.tensor(ids[1:])).item())


def token_agreement(reference: list[list[int]], other: list[list[int]]) -> tuple[float, float]:
    before, same, total = [], 0, 0
    for ref, out in zip(reference, other, strict=True):
        prefix = next(
            (i for i, (x, y) in enumerate(zip(ref, out, strict=False)) if x != y), min(len(ref), len(out))
        )
        before.append(prefix / len(ref))
        same += sum(x == y for x, y in zip(ref, out, strict=False))
        total += len(ref)
    return statistics.mean(before), same / total


# --------------------------------------------------------------------------------------------- plot


def plot(report: Report, samples: list[KVSample], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(17, 9.5))
    ((ax_tp, ax_ttft, ax_kv), (ax_b1, ax_qtp, ax_acc)) = axes

    runs = [r for r in (report.hf, report.engine) if r is not None]
    labels = ["HF static batch" if r is report.hf else "engine" for r in runs]
    bars = ax_tp.bar(
        labels, [r.output_tokens_per_s for r in runs], color=["tab:gray", "tab:blue"][-len(runs) :]
    )
    ax_tp.bar_label(bars, fmt="%.1f")
    title = "Output tokens/s (useful tokens / wall time)"
    if report.speedup_vs_hf:
        title += f"\nengine / HF = {report.speedup_vs_hf:.2f}x"
    ax_tp.set_title(title)
    ax_tp.set_ylabel("tokens/s")

    for r, label, color in zip(runs, labels, ["tab:gray", "tab:blue"][-len(runs) :], strict=True):
        xs = sorted(r.ttft_s)
        ax_ttft.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=label, color=color)
        ax_ttft.axvline(r.ttft_p50_s, color=color, ls=":", lw=1)
    ax_ttft.set_title("Time to first token, CDF (all submitted at t=0)")
    ax_ttft.set_xlabel("seconds")
    ax_ttft.set_ylabel("fraction of requests")
    ax_ttft.legend()

    kv = report.kv_util
    live = [s for s in samples if s.running and s.reserved]
    ax_kv.plot(
        [s.t for s in live], [s.stored / s.reserved for s in live], label="paged (stored / block tokens)"
    )
    ax_kv.plot(
        [s.t for s in live],
        [s.stored / (s.running * kv.max_model_len) for s in live],
        label=f"contiguous (stored / running x {kv.max_model_len})",
    )
    ax_kv.axhline(0.9, color="k", ls=":", lw=1)
    ax_kv.set_ylim(0, 1.05)
    ax_kv.set_title(
        f"KV utilisation per step (time avg: paged {kv.paged_time_avg:.1%}, "
        f"contiguous {kv.contiguous_time_avg:.1%})",
        fontsize=10,
    )
    ax_kv.set_xlabel("seconds since submission")
    ax_kv.legend(loc="lower right")

    names = [b.quantization for b in report.batch1]
    x = range(len(names))
    bars = ax_b1.bar(x, [b.decode_tokens_per_s for b in report.batch1], color="tab:blue", label="measured")
    ax_b1.bar_label(
        bars, labels=[f"{b.decode_tokens_per_s:.1f}\n{b.pct_of_roofline:.0%}" for b in report.batch1]
    )
    for attr, color, label in (
        ("roofline_tokens_per_s", "tab:red", "roofline (all weight bytes)"),
        ("streamed_roofline_tokens_per_s", "tab:orange", "roofline (streamed bytes)"),
    ):
        values = [getattr(b, attr) for b in report.batch1]
        ax_b1.scatter(x, values, marker="_", s=900, color=color, label=label, zorder=3)
    ax_b1.set_xticks(list(x), names)
    ax_b1.set_title(f"Batch-1 decode tokens/s vs roofline ({report.bandwidth.roofline_gbps:.1f} GB/s)")
    ax_b1.legend(fontsize=8)

    qnames = [r.name.removeprefix("engine_") for r in report.quant_throughput]
    bars = ax_qtp.bar(qnames, [r.output_tokens_per_s for r in report.quant_throughput], color="tab:green")
    ax_qtp.bar_label(bars, fmt="%.1f")
    n = report.quant_throughput[0].num_requests if report.quant_throughput else 0
    ax_qtp.set_title(f"Engine output tokens/s by quantization ({n} requests)")

    acc = report.accuracy
    xs = range(len(acc))
    ax_acc.bar(
        [i - 0.2 for i in xs],
        [a.agreement_before_divergence for a in acc],
        0.4,
        label="agreement before 1st divergence",
    )
    ax_acc.bar([i + 0.2 for i in xs], [a.agreement_overall for a in acc], 0.4, label="agreement overall")
    ax_acc.set_xticks(list(xs), [f"{a.quantization}\nppl {a.perplexity:.3f}" for a in acc])
    ax_acc.set_ylim(0, 1.1)
    ax_acc.set_title("Greedy token agreement vs unquantized engine")
    ax_acc.legend(fontsize=8, loc="lower left")

    m = report.machine
    fig.suptitle(
        f"{report.benchmark}{' (quick)' if report.quick else ''}: {Path(report.model).name}, "
        f"{m.threads} threads, {m.cpu_model}, torch {m.torch_version}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------------------------- main


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
        "engine": {
            "dtype": "float32",
            "max_num_seqs": 64,
            "max_num_batched_tokens": 512,
            "tokens_per_block": 16,
            "kv_cache_memory_bytes": kv_bytes,
        },
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

    from transformers import AutoModelForCausalLM, AutoTokenizer

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
        log("HF baseline: loading the model in float32")
        hf_model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        hf_generate_batch(hf_model, [Request("warmup", source.take(32), 4)], pad_id)
        hf_result, hf_outputs = run_hf(hf_model, requests, args.hf_batch_size, pad_id)
        phase_done("hf")
        log(
            f"HF: {hf_result.output_tokens_per_s:.1f} tok/s, wall {hf_result.wall_s:.1f} s, TTFT p50 "
            f"{hf_result.ttft_p50_s:.2f} s p95 {hf_result.ttft_p95_s:.2f} s"
        )
        with torch.inference_mode():
            logits = hf_model(torch.tensor([ppl_ids])).logits[0]
        hf_ppl = logits_perplexity(logits, ppl_ids)
        del hf_model, logits
        gc.collect()

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

    log(f"batch-1 decode: {batch1_runs} runs x {len(quants)} quantizations, interleaved")
    decode_runs: dict[str, list[float]] = {q: [] for q in quants}
    step_times: dict[str, list[float]] = {q: [] for q in quants}
    for run in tqdm(range(batch1_runs), desc="batch-1 runs", file=sys.stdout):
        for q, eng in engines.items():
            tps, steps = batch1_decode(
                eng, source.take(batch1_prompt), batch1_output, f"b1-{q}-{run}", batch1_budget_s
            )
            decode_runs[q].append(tps)
            step_times[q].extend(steps)
    phase_done("batch1")
    batch1 = []
    for q, eng in engines.items():
        total, streamed = weight_bytes(eng.runner.model)
        tps = statistics.median(decode_runs[q])
        roof, sroof = bandwidth.roofline_gbps * 1e9 / total, bandwidth.roofline_gbps * 1e9 / streamed
        batch1.append(
            Batch1Result(
                quantization=q,
                prompt_tokens=batch1_prompt,
                output_tokens=batch1_output,
                decode_tokens_per_s_runs=decode_runs[q],
                decode_steps_timed=len(step_times[q]),
                decode_tokens_per_s=tps,
                median_step_ms=statistics.median(step_times[q]) * 1e3,
                weight_bytes=total,
                streamed_bytes=streamed,
                roofline_tokens_per_s=roof,
                pct_of_roofline=tps / roof,
                streamed_roofline_tokens_per_s=sroof,
                pct_of_streamed_roofline=tps / sroof,
            )
        )
        log(
            f"batch-1 {q}: {tps:.1f} tok/s (runs {', '.join(f'{x:.1f}' for x in decode_runs[q])}); "
            f"{total / 1e6:.0f} MB -> roofline {roof:.1f} tok/s = {tps / roof:.0%}; "
            f"streamed {streamed / 1e6:.0f} MB -> {sroof:.1f} tok/s = {tps / sroof:.0%}"
        )

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
    generated = {q: eng.generate(prompts, greedy(accuracy_tokens)) for q, eng in engines.items()}
    accuracy = []
    for q, eng in engines.items():
        before, overall = token_agreement(generated["none"], generated[q])
        ppl = perplexity(eng.runner, ppl_ids, window=len(ppl_ids))
        accuracy.append(
            AccuracyResult(q, accuracy_prompts, accuracy_tokens, before, overall, ppl, len(ppl_ids))
        )
        log(f"  {q}: agreement {before:.1%} before divergence, {overall:.1%} overall; perplexity {ppl:.4f}")
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
    json_path, png_path = out_dir / f"{stem}.json", out_dir / f"{stem}.png"
    json_path.write_text(json.dumps(asdict(report), indent=2) + "\n")
    raw = {
        "kv_samples": [asdict(s) for s in samples],
        "requests": [
            {"id": r.request_id, "prompt_tokens": len(r.prompt), "max_tokens": r.max_tokens} for r in requests
        ],
        "batch1_step_s": step_times,
    }
    (out_dir / "raw" / f"{stem}_raw.json").write_text(json.dumps(raw) + "\n")
    plot(report, samples, png_path)
    print_summary(report)
    log(f"wrote {json_path}, {png_path}, {out_dir / 'raw' / f'{stem}_raw.json'}")
    return 0


def print_summary(r: Report) -> None:
    def check(ok: bool) -> str:
        return "ok" if ok else "BELOW TARGET"

    lines = [
        "",
        f"=== {r.benchmark}{' (quick)' if r.quick else ''} ===",
        f"{r.machine.cpu_model}, {r.machine.threads} threads, torch {r.machine.torch_version}",
    ]
    for t in (r.hf, r.engine):
        if t is not None:
            lines.append(
                f"{t.name:>20}: {t.output_tokens_per_s:7.1f} out tok/s  wall {t.wall_s:6.1f} s  "
                f"TTFT p50 {t.ttft_p50_s:6.2f} s  p95 {t.ttft_p95_s:6.2f} s"
            )
    if r.speedup_vs_hf:
        lines.append(
            f"{'speedup':>20}: {r.speedup_vs_hf:.2f}x  (target >= 3x: {check(r.speedup_vs_hf >= 3)})"
        )
    if r.hf_engine_token_agreement is not None:
        lines.append(
            f"{'HF/engine agreement':>20}: {r.hf_engine_token_agreement:.1%} of output tokens identical"
        )
    kv = r.kv_util
    lines.append(
        f"{'KV utilisation':>20}: paged {kv.paged_time_avg:.1%} (min {kv.paged_min:.1%}) vs contiguous "
        f"{kv.contiguous_time_avg:.1%}  (target > 90%: {check(kv.paged_time_avg > 0.9)})"
    )
    lines.append(f"{'bandwidth':>20}: {r.bandwidth.roofline_gbps:.1f} GB/s ({r.bandwidth.roofline_method})")
    for b in r.batch1:
        lines.append(
            f"{'batch-1 ' + b.quantization:>20}: {b.decode_tokens_per_s:6.1f} tok/s  roofline "
            f"{b.roofline_tokens_per_s:6.1f} ({b.pct_of_roofline:.0%}, target 70%: "
            f"{check(b.pct_of_roofline >= 0.7)})  streamed-bytes roofline "
            f"{b.streamed_roofline_tokens_per_s:6.1f} ({b.pct_of_streamed_roofline:.0%})"
        )
    for t in r.quant_throughput:
        lines.append(f"{t.name:>20}: {t.output_tokens_per_s:7.1f} out tok/s ({t.num_requests} requests)")
    for a in r.accuracy:
        lines.append(
            f"{'accuracy ' + a.quantization:>20}: agreement {a.agreement_before_divergence:.1%} before "
            f"divergence, {a.agreement_overall:.1%} overall; perplexity {a.perplexity:.4f}"
        )
    if r.hf_perplexity is not None:
        lines.append(f"{'HF perplexity':>20}: {r.hf_perplexity:.4f}")
    busy = [f"{c.phase} {c.loadavg_1m:.1f}" for c in r.cpu_load]
    lines.append(f"{'load average (1m)':>20}: {', '.join(busy)} (on {r.machine.logical_cpus} CPUs)")
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
