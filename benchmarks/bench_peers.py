"""This project's server against llama.cpp's `llama-server` and vLLM CPU, side by side on this machine.

Every server gets the same token-id requests (random ids from a fixed seed, no shared prefixes),
greedy, exact output lengths (EOS ignored), streamed, on loopback; one server at a time runs all the
workloads, then stops (always, also on error or Ctrl-C), then the next starts:

  b1       1 request at a time, 128-token prompt, 128 tokens out, repeated (median decode rate)
  c8, c32  8 / 32 requests at once, 128/128
  mixed    64 requests at once, prompts 32-512, outputs 16-256
  poisson  open-loop Poisson arrivals (0.5 req/s, prompts 16-1024, outputs 8-384, at most 60 requests
           or 120 s of arrivals)
  long     1 request at a time, 1,792-token prompt, 256 tokens out, 3 repetitions: prefill (TTFT p50) and
           decode rate at a long context (2,048 tokens: the context every peer is started with)
  b1x      (with --interleave-b1 N) batch 1 again, 128/128, but with every server up at once and one
           request to each in turn, N rounds: this machine's speed drifts over minutes, which the
           one-server-after-another runs above fold into their ratios; here it hits every server alike
  c32x     (with --interleave-c32 N) 32 at once again, 128/128, interleaved the same way: N rounds of a
           fresh burst of 32 to each server in turn (tok/s: the median of the rounds)
  Each interleaved turn starts once the CPUs are quiet (vLLM's server stays busy ~1 s after an answer).

Servers: `tritonllm` (`.venv/bin/tritonllm launch`, gRPC streaming into `tensorrt_llm`; once per
--tritonllm-args), `llama-bf16`, `llama-q8_0` and `llama-q4_0` (llama-server on GGUFs converted from the
same HF folder; q4_0 quantized from the bf16 one by llama-quantize), `vllm` (vLLM CPU's OpenAI server,
bf16). Set-up is cached in .cache/peers/ (first run: the llama.cpp build takes 10-20 min on 2 cores, the
vLLM install a few minutes).

Writes <out>/<name>.json and .md (tables, CPU flags, load average), <out>/<name>.png (throughput, TTFT
and inter-token gaps side by side: `peers/plot.py`) and <out>/raw/<name>-<time>.json
(every request's chunk arrival times) plus the server logs in <out>/raw/.

    .venv/bin/python benchmarks/bench_peers.py --quick
    .venv/bin/python benchmarks/bench_peers.py --tritonllm-args "" --tritonllm-args "--quantization int8"
    .venv/bin/python benchmarks/bench_peers.py --servers tritonllm,llama-bf16 --workloads b1,c32
    .venv/bin/python benchmarks/bench_peers.py --servers tritonllm,llama-q8_0 --workloads "" \
        --interleave-b1 15
    .venv/bin/python benchmarks/bench_peers.py --servers tritonllm,llama-q4_0 --workloads b1 \
        --tritonllm-args "--quantization int4"
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from peers import install, servers
from peers.plot import figure
from peers.quiet import wait_until_quiet
from peers.report import cpu_info, markdown
from peers.workloads import (
    INTERLEAVED_ROUND_SIZE,
    RequestSpec,
    Scale,
    Workload,
    interleaved_b1,
    interleaved_c32,
    make_workloads,
    run_workload,
    summarise,
    summarise_rounds,
)

from tritonllm.default_model import model_path_or_default
from tritonllm.engine.config import auto_quantization

SERVERS = ("tritonllm", "llama-bf16", "llama-q8_0", "llama-q4_0", "vllm")
WORKLOADS = ("b1", "c8", "c32", "mixed", "poisson", "long")


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def weights_of(engine_args: str, model_dir: Path) -> str:
    """What this project's linears read, from the launch options (quantization, else dtype); `auto` (the
    launcher's default) resolved as the server on this machine resolves it."""
    tokens = shlex.split(engine_args)
    flags = ("--quantization", "--dtype")
    value = {flag: tokens[i + 1] for i, flag in enumerate(tokens[:-1]) if flag in flags}
    quantization = value.get("--quantization", "auto")
    if quantization == "auto":
        quantization = auto_quantization(str(model_dir), "cpu")
    return quantization if quantization != "none" else value.get("--dtype", "default dtype")


def wanted_servers(spec: str) -> list[str]:
    """The servers `--servers` names; exits naming any unknown one (before anything is written)."""
    wanted = spec.split(",")
    unknown = set(wanted) - set(SERVERS)
    if unknown:
        raise SystemExit(f"--servers: unknown {sorted(unknown)}; choose from {', '.join(SERVERS)}")
    return wanted


def build_peers(args: argparse.Namespace, model_dir: Path, log_dir: Path) -> list[tuple[str, Callable]]:
    """(name, factory) per server to run, in order; a factory installs its server on first use."""
    wanted = wanted_servers(args.servers)
    timeout = args.request_timeout

    def ours(engine_args: str) -> Callable[[], servers.Peer]:
        label = f"tritonllm {engine_args}".strip()
        weights = weights_of(engine_args, model_dir)
        return lambda: servers.tritonllm(
            label, weights, model_dir, engine_args, args.threads, log_dir, timeout, args.ready_timeout
        )

    def llama(outtype: str) -> Callable[[], servers.Peer]:
        def factory() -> servers.Peer:
            binary, gguf = install.llama_server_binary(), install.gguf(model_dir, outtype)
            label = f"llama-{outtype}"
            options = (
                f"-t {args.threads} -np {args.llama_slots} -c {args.llama_slots * 2048} {args.llama_args}"
                f"{llama_amx_workaround(args.llama_args)}"
            )
            return servers.llama_server(label, outtype, binary, gguf, shlex.split(options), log_dir, timeout)

        return factory

    def vllm() -> servers.Peer:
        venv = install.vllm_venv()
        return servers.vllm_server(venv, str(model_dir), args.vllm_dtype, args.threads, log_dir, timeout)

    plan: list[tuple[str, Callable[[], servers.Peer]]] = []
    if "tritonllm" in wanted:
        plan += [(f"tritonllm {a}".strip(), ours(a)) for a in args.tritonllm_args or [""]]
    plan += [(f"llama-{o}", llama(o)) for o in ("bf16", "q8_0", "q4_0") if f"llama-{o}" in wanted]
    if "vllm" in wanted:
        plan.append(("vllm", vllm))
    return plan


def warmup() -> Workload:
    """A few short requests after start-up (first-call costs: kernel builds, graph captures)."""
    burst = tuple(RequestSpec(tuple(range(200, 264)), 16) for _ in range(4))
    return Workload("warmup", "warm-up", burst)


@dataclasses.dataclass
class Run:
    """What was measured so far; `write()` saves it (JSON, markdown, raw requests), returns the tables."""

    meta: dict[str, Any]
    titles: dict[str, str]
    out: Path
    name: str
    raw_dir: Path
    summaries: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    weights: dict[str, str] = dataclasses.field(default_factory=dict)
    raw: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    failures: dict[str, str] = dataclasses.field(default_factory=dict)

    def write(self) -> str:
        self.meta["load_after"] = os.getloadavg()
        ours = [label for label in self.summaries if label.startswith("tritonllm")]
        table = markdown(self.summaries, self.weights, ours, self.titles, self.meta)
        if self.failures:
            reasons = "; ".join(
                f"{label}: {reason.splitlines()[0]}" for label, reason in self.failures.items()
            )
            table += f"\nNot measured: {reasons}\n"
        (self.out / f"{self.name}.md").write_text(f"Command: `{self.meta['command']}`\n\n" + table)
        result = {
            "meta": self.meta,
            "weights": self.weights,
            "summaries": self.summaries,
            "failures": self.failures,
        }
        (self.out / f"{self.name}.json").write_text(json.dumps(result, indent=2) + "\n")
        figure(result, self.out / f"{self.name}.png")
        (self.raw_dir / "requests.json").write_text(json.dumps(self.raw) + "\n")
        return table


def measure(peer: servers.Peer, workloads: list[Workload], ready_timeout_s: float, run: Run) -> None:
    """Start the server, warm it up, run every workload on it, stop it (also on error)."""
    label = peer.server.label
    run.weights[label] = peer.server.weights
    log(f"{label}: starting ({' '.join(peer.server.command[:3])} ...)")
    with peer.server.running(ready_timeout_s) as ready_s:
        log(f"{label}: ready after {ready_s:.0f} s; warm-up")
        run_workload(warmup(), peer.stream)
        run.meta.setdefault("load_at_start", {})[label] = os.getloadavg()
        run.summaries[label], run.raw[label] = {}, {}
        for workload in workloads:
            log(f"{label}: {workload.name} ({len(workload.requests)} requests) ...")
            results = run_workload(workload, peer.stream)
            s = summarise(results, workload.sequential)
            run.summaries[label][workload.name] = s
            run.raw[label][workload.name] = [dataclasses.asdict(r) for r in results]
            log(
                f"{label}: {workload.name}: {s['out_tok_s'] or 0:.1f} tok/s, TTFT p50/p95 "
                f"{s['ttft_p50_ms'] or 0:.0f}/{s['ttft_p95_ms'] or 0:.0f} ms, errors {s['errors']}"
                + ("" if s["exact_lengths"] else f", INEXACT output lengths; first error: {s['first_error']}")
            )
    log(f"{label}: stopped")


def measure_interleaved(
    peers: list[servers.Peer], interleaved: list[Workload], ready_timeout_s: float, run: Run
) -> None:
    """Every server up at once (idle ones sleep), warmed up; then each round of each workload (one request
    of b1x, a burst of 32 of c32x) goes to every server in turn, the order rotated per round, each turn
    once the CPUs are quiet again (peers/quiet.py). b1x is summarised like b1 (median decode rate), c32x by
    the median of its rounds' rates."""
    results: dict[str, dict[str, list]] = {}
    with contextlib.ExitStack() as stack:
        for peer in peers:
            label = peer.server.label
            run.weights[label] = peer.server.weights
            log(f"{label}: starting for {', '.join(w.name for w in interleaved)}")
            stack.enter_context(peer.server.running(ready_timeout_s))
            run_workload(warmup(), peer.stream)
            results[label] = {w.name: [] for w in interleaved}
        for workload in interleaved:
            size = INTERLEAVED_ROUND_SIZE[workload.name]
            rounds = [workload.requests[i : i + size] for i in range(0, len(workload.requests), size)]
            log(f"{workload.name}: {len(rounds)} rounds over {len(peers)} servers")
            previous = "start"
            for i, specs in enumerate(rounds):
                for peer in peers[i % len(peers) :] + peers[: i % len(peers)]:
                    waited = wait_until_quiet()
                    log(f"{workload.name} round {i}: CPUs quiet {waited:.1f} s after {previous}")
                    previous = peer.server.label
                    one = Workload(workload.name, workload.title, specs, sequential=workload.sequential)
                    done = run_workload(one, peer.stream)
                    for result in done:
                        result.round = i
                    results[peer.server.label][workload.name] += done
    for label, per_workload in results.items():
        for workload in interleaved:
            done = per_workload[workload.name]
            s = summarise(done, sequential=True) if workload.sequential else summarise_rounds(done)
            run.summaries.setdefault(label, {})[workload.name] = s
            run.raw.setdefault(label, {})[workload.name] = [dataclasses.asdict(r) for r in done]
            log(f"{label}: {workload.name}: {s['out_tok_s'] or 0:.1f} tok/s, errors {s['errors']}")


def git_commit() -> str:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False)
    return out.stdout.strip()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--servers",
        default=",".join(SERVERS),
        help=f"comma-separated servers to run; they run in the order {','.join(SERVERS)} (default: all)",
    )
    parser.add_argument(
        "--workloads",
        default=",".join(WORKLOADS),
        help=f"comma-separated workloads (default: {','.join(WORKLOADS)})",
    )
    parser.add_argument(
        "--tritonllm-args",
        action="append",
        metavar="ARGS",
        help='engine options for `tritonllm launch` (e.g. "--quantization int8 --dtype auto"); '
        'repeat to run several variants, "" is the defaults (default: one run with the '
        "defaults). Compared with llama.cpp q4_0 when the options say int4/q4/w4, q8_0 when "
        "int8/q8/w8, else bf16",
    )
    parser.add_argument(
        "--interleave-b1",
        type=int,
        default=0,
        metavar="N",
        help="after the workloads, N rounds of the b1x workload: all servers up at once, one batch-1 "
        "request to each in turn (default 0: not run)",
    )
    parser.add_argument(
        "--interleave-c32",
        type=int,
        default=0,
        metavar="N",
        help="after the workloads (and b1x), N rounds of the c32x workload: all servers up at once, a "
        "burst of 32 requests to each in turn (default 0: not run)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smaller workloads: 3 batch-1 runs, 64/64 for b1/c8/c32, 32 mixed requests, "
        "at most 24 Poisson requests or 50 s of arrivals",
    )
    parser.add_argument(
        "--model", help="HF folder (default: the project's default model, SmolLM2-135M-Instruct)"
    )
    parser.add_argument("--threads", type=int, default=2, help="CPU threads for every server (default 2)")
    parser.add_argument(
        "--llama-slots",
        type=int,
        default=32,
        help="llama-server parallel sequences (-np), 2048 tokens each (default 32)",
    )
    parser.add_argument(
        "--llama-args",
        default="--cache-ram 0",
        metavar="ARGS",
        help='more llama-server options (default "--cache-ram 0"; e.g. add "--poll 0" on a machine '
        "shared with other work, where its spinning threads lose their cores)",
    )
    parser.add_argument(
        "--vllm-dtype",
        default="bfloat16",
        choices=["bfloat16", "float32", "float16"],
        help="vLLM's --dtype (default bfloat16, as the issue measured; on a CPU without "
        "avx512_bf16/amx_bf16 its bf16 runs without native bf16 dot products)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompts and the Poisson arrivals")
    parser.add_argument(
        "--ready-timeout",
        type=float,
        default=900.0,
        help="seconds a server may take to become ready (default 900)",
    )
    parser.add_argument(
        "--request-timeout",
        type=float,
        default=600.0,
        help="seconds a request may wait for its next chunk (default 600)",
    )
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"), help="results folder")
    parser.add_argument("--name", default="peers", help="results file stem (default: peers)")
    return parser.parse_args()


def llama_amx_workaround(llama_args: str) -> str:
    """ " --no-repack" on AMX CPUs, unless the options say otherwise.

    Built for such a CPU (`GGML_NATIVE`), the llama.cpp in llama-cpp-python 0.3.36 moves q8_0 and bf16 weights
    into its AMX buffer type and died there at its first tile instruction (SIGILL at `tilezero` in
    `tinygemm_kernel_amx`, during llama-server's warm-up; Xeon with AMX, 2026-12-06), a bug upstream
    ggml-org/llama.cpp#26954 describes (tile permission asked on one thread only). `--no-repack` keeps the
    weights in plain buffers: on x86 that only turns the AMX path off (q8_0 and bf16 have no other repacking).
    """
    chosen = re.search(r"(^|\s)(-nr|--no-repack|--repack)(\s|$)", llama_args)
    if "amx_int8" not in cpu_info()["cpu_flags"] or chosen:
        return ""
    return " --no-repack"


def main() -> int:
    args = parse_args()
    # SIGTERM ends the run like Ctrl-C: the running server is stopped on the way out.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    model_dir = Path(model_path_or_default(args.model))
    vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    scale = Scale.quick() if args.quick else Scale()
    all_workloads = make_workloads(vocab_size, args.seed, scale)
    names = [n for n in args.workloads.split(",") if n]
    if set(names) - set(WORKLOADS):
        raise SystemExit(f"--workloads: unknown {sorted(set(names) - set(WORKLOADS))}")
    workloads = [all_workloads[n] for n in WORKLOADS if n in names]
    wanted_servers(args.servers)
    out = Path(args.out)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    raw_dir = out / "raw" / f"{args.name}-{stamp}"
    raw_dir.mkdir(parents=True, exist_ok=True)
    meta = {
        **cpu_info(),
        "load_before": os.getloadavg(),
        "command": " ".join(map(shlex.quote, sys.argv)),
        "model": model_dir.name,
        "commit": git_commit(),
        "started": stamp,
        "scale": dataclasses.asdict(scale),
        "seed": args.seed,
    }
    log(f"CPU {meta['cpu_model']} flags {meta['cpu_flags']}; load average {meta['load_before']}")

    interleaved = (
        [interleaved_b1(vocab_size, args.seed, scale, args.interleave_b1)] if args.interleave_b1 else []
    )
    if args.interleave_c32:
        interleaved.append(interleaved_c32(vocab_size, args.seed, scale, args.interleave_c32))
    titles = {w.name: w.title for w in workloads + interleaved}
    run = Run(meta, titles, out, args.name, raw_dir)
    try:
        plan = build_peers(args, model_dir, raw_dir)
        for name, factory in plan if workloads else []:
            log(f"{name}: set-up")
            try:
                measure(factory(), workloads, args.ready_timeout, run)
            except Exception as exc:  # one server failing (install, start) must not lose the others' figures
                run.failures[name] = f"{type(exc).__name__}: {exc}"
                log(f"{name}: FAILED: {run.failures[name]}")
            run.write()
        if interleaved:
            try:
                measure_interleaved([factory() for _, factory in plan], interleaved, args.ready_timeout, run)
            except Exception as exc:  # keep the per-server figures
                name = "+".join(w.name for w in interleaved)
                run.failures[name] = f"{type(exc).__name__}: {exc}"
                log(f"{name}: FAILED: {run.failures[name]}")
    finally:  # also on Ctrl-C / SIGTERM: keep what was measured
        print(run.write())
    log(f"wrote {out / args.name}.md, .json, .png and {raw_dir}")
    return 1 if run.failures else 0


if __name__ == "__main__":
    sys.exit(main())
