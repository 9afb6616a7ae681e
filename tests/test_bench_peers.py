"""Pure parts of benchmarks/bench_peers.py: the workloads are deterministic, the summaries and the
ratio table compute right. No server runs here (the benchmark itself is run by hand)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_peers.py"
sys.path.insert(0, str(BENCH.parent))

from peers.quiet import busy_share, cpu_times, wait_until_quiet  # noqa: E402
from peers.report import llama_counterpart, markdown, ratios  # noqa: E402
from peers.workloads import (  # noqa: E402
    FIRST_ORDINARY_ID,
    INTERLEAVED_ROUND_SIZE,
    SEQUENTIAL,
    RequestResult,
    Scale,
    interleaved_b1,
    interleaved_c32,
    make_workloads,
    summarise,
    summarise_rounds,
)

VOCAB = 49152


def test_workloads_are_deterministic_within_vocab_and_bounded() -> None:
    first, again = make_workloads(VOCAB, 0, Scale()), make_workloads(VOCAB, 0, Scale())
    assert first == again
    assert make_workloads(VOCAB, 1, Scale())["c8"] != first["c8"]
    ids = [t for w in first.values() for r in w.requests for t in r.prompt_ids]
    assert min(ids) >= FIRST_ORDINARY_ID and max(ids) < VOCAB
    assert [len(first[n].requests) for n in ("b1", "c8", "c32", "mixed")] == [5, 8, 32, 64]
    assert all(len(r.prompt_ids) == 128 and r.max_tokens == 128 for r in first["c32"].requests)
    mixed = first["mixed"].requests
    assert all(32 <= len(r.prompt_ids) <= 512 and 16 <= r.max_tokens <= 256 for r in mixed)
    assert len({r.prompt_ids[:16] for r in mixed}) == len(mixed)  # no shared prefixes
    poisson = first["poisson"].requests
    times = [r.send_at_s for r in poisson]
    assert times == sorted(times) and times[0] == 0.0 and times[-1] <= Scale().poisson_max_duration_s
    assert 1 < len(poisson) <= Scale().poisson_max_requests
    assert all(16 <= len(r.prompt_ids) <= 1024 and 8 <= r.max_tokens <= 384 for r in poisson)
    long = first["long"]
    assert long.sequential and len(long.requests) == 3
    # The plot re-summarises raw requests by name: SEQUENTIAL must name the workloads sent one at a time.
    interleaved = [interleaved_b1(VOCAB, 0, Scale(), 2), interleaved_c32(VOCAB, 0, Scale(), 1)]
    assert {w.name for w in [*first.values(), *interleaved] if w.sequential} == set(SEQUENTIAL)
    assert all(len(r.prompt_ids) + r.max_tokens == 2048 and r.max_tokens == 256 for r in long.requests)


def test_summarise_ttft_gaps_and_rates() -> None:
    # Sent at 1.0; first token at 1.5; then 2 tokens at 2.0 and 1 at 2.5: gaps 250, 250, 500 ms.
    r = RequestResult(sent_s=1.0, max_tokens=4, chunks=[(1.5, 1), (2.0, 2), (2.5, 1)])
    failed = RequestResult(sent_s=0.0, max_tokens=4, error="RuntimeError: boom")
    s = summarise([r, failed], sequential=False)
    assert s["errors"] == 1 and not s["exact_lengths"] and s["first_error"] == "RuntimeError: boom"
    assert s["ttft_p50_ms"] == pytest.approx(500)
    assert s["itl_p50_ms"] == pytest.approx(250)
    assert s["itl_max_ms"] == pytest.approx(500) and 250 < s["itl_p99_ms"] <= 500
    assert s["out_tok_s"] == pytest.approx(4 / 2.5)  # wall from the first send (0.0) to the last token
    sequential = summarise([r], sequential=True)
    assert sequential["exact_lengths"] and sequential["out_tok_s"] == pytest.approx(3 / 1.0)


def _summary(tok_s: float, ttft_p95: float = 100.0, ttft_p50: float = 50.0) -> dict:
    return {"requests": 1, "errors": 0, "exact_lengths": True, "out_tok_s": tok_s, "ttft_p50_ms": ttft_p50,
            "ttft_p95_ms": ttft_p95, "itl_p50_ms": 10.0, "itl_p95_ms": 20.0, "itl_p99_ms": 30.0,
            "itl_max_ms": 40.0}  # fmt: skip


def test_ratios_pair_same_weight_bits_and_vllm() -> None:
    summaries = {
        "tritonllm": {
            "b1": _summary(30.0),
            "poisson": _summary(10.0, ttft_p95=500.0),
            "long": _summary(20.0, ttft_p50=300.0),
        },
        "tritonllm --quantization int8": {"b1": _summary(90.0)},
        "llama-bf16": {
            "b1": _summary(60.0),
            "poisson": _summary(12.0, ttft_p95=1000.0),
            "long": _summary(25.0, ttft_p50=1200.0),
        },
        "llama-q8_0": {"b1": _summary(120.0)},
        "vllm-bf16": {"b1": _summary(40.0)},
    }
    weights = {"tritonllm": "default dtype", "tritonllm --quantization int8": "int8", "llama-bf16": "bf16",
               "llama-q8_0": "q8_0", "vllm-bf16": "bf16"}  # fmt: skip
    assert llama_counterpart("int8_wo") == "llama-q8_0" and llama_counterpart("bfloat16") == "llama-bf16"
    ours = ["tritonllm", "tritonllm --quantization int8"]
    table = ratios(summaries, ours, weights)
    assert table["tritonllm"]["b1/llama-bf16"] == pytest.approx(0.5)
    assert table["tritonllm"]["b1/vllm-bf16"] == pytest.approx(0.75)
    assert table["tritonllm"]["poisson_ttft_p95/llama-bf16"] == pytest.approx(0.5)
    assert table["tritonllm"]["poisson/vllm-bf16"] is None  # vLLM did not run that workload
    assert table["tritonllm"]["long/llama-bf16"] == pytest.approx(0.8)
    assert table["tritonllm"]["long_ttft_p50/llama-bf16"] == pytest.approx(0.25)  # the prefill, < 1 faster
    assert table["tritonllm --quantization int8"]["b1/llama-q8_0"] == pytest.approx(0.75)
    meta = {
        "cpu_model": "cpu",
        "cores": 2,
        "cpu_flags": ["avx2"],
        "load_before": (1, 1, 1),
        "load_after": (2, 2, 2),
    }
    titles = {"b1": "1 request", "poisson": "Poisson", "long": "long prompt"}
    text = markdown(summaries, weights, ours, titles, meta)
    assert "| tritonllm --quantization int8 | llama-q8_0 | 0.75 | - | - | - | - |" in text
    assert "| ours | peer | b1 | poisson | long | Poisson TTFT p95 | long TTFT p50 |" in text
    assert "| tritonllm | llama-bf16 | 0.50 | 0.83 | 0.80 | 0.50 | 0.25 |" in text
    assert "flags: avx2" in text


def test_four_bit_weights_pair_with_llama_q4_0() -> None:
    """4-bit options (int4 / q4 / w4 in the weights string) compare against llama.cpp q4_0, 8-bit ones
    (and int7, which llama.cpp has no format for) against q8_0, and the ratio table pairs them so."""
    for weights in ("int4", "int4_wo", "q4_0", "w4a16"):
        assert llama_counterpart(weights) == "llama-q4_0", weights
    for weights in ("int8", "int7", "q8_0", "w8a8"):
        assert llama_counterpart(weights) == "llama-q8_0", weights
    assert llama_counterpart("float32") == "llama-bf16"
    summaries = {
        "tritonllm --quantization int4": {"b1": _summary(200.0)},
        "llama-q4_0": {"b1": _summary(160.0)},
        "llama-q8_0": {"b1": _summary(120.0)},
    }
    weights = {"tritonllm --quantization int4": "int4", "llama-q4_0": "q4_0", "llama-q8_0": "q8_0"}
    ours = ["tritonllm --quantization int4"]
    row = ratios(summaries, ours, weights)["tritonllm --quantization int4"]
    assert row["b1/llama-q4_0"] == pytest.approx(1.25) and "b1/llama-q8_0" not in row
    meta = {"cpu_model": "cpu", "cores": 2, "cpu_flags": [], "load_before": (1,) * 3, "load_after": (1,) * 3}
    text = markdown(summaries, weights, ours, {"b1": "1 request"}, meta)
    assert "| tritonllm --quantization int4 | llama-q4_0 | 1.25 |" in text


def test_llama_q4_0_is_a_server_choice_planned_after_q8_0(tmp_path: Path) -> None:
    """`--servers ...,llama-q4_0` plans a llama-server on the q4_0 GGUF (nothing installed or started:
    the factories are not called), and int4 launch options read as int4 weights."""
    import argparse

    import bench_peers

    assert "llama-q4_0" in bench_peers.SERVERS
    args = argparse.Namespace(
        servers="llama-q4_0,tritonllm,llama-q8_0",
        tritonllm_args=["--quantization int4"],
        request_timeout=1.0,
        threads=2,
        ready_timeout=1.0,
        llama_slots=1,
        llama_args="",
        vllm_dtype="bfloat16",
    )
    plan = [name for name, _ in bench_peers.build_peers(args, tmp_path, tmp_path)]
    assert plan == ["tritonllm --quantization int4", "llama-q8_0", "llama-q4_0"]
    assert bench_peers.weights_of("--quantization int4", tmp_path) == "int4"


def test_tritonllm_serves_the_model_the_peers_are_given(tmp_path: Path) -> None:
    """`--model DIR` once reached llama.cpp and vLLM only: `tritonllm launch` served the default model and
    the table compared different models. Building the peer starts nothing."""
    import argparse

    import bench_peers

    args = argparse.Namespace(
        servers="tritonllm", tritonllm_args=[""], request_timeout=1.0, threads=2, ready_timeout=1.0,
        llama_slots=1, llama_args="", vllm_dtype="bfloat16",
    )  # fmt: skip
    model_dir = tmp_path / "RandomLlama-3.2-1B"
    [(_, factory)] = bench_peers.build_peers(args, model_dir, tmp_path)
    command = factory().server.command
    assert command[command.index("--model") + 1] == str(model_dir)
    assert factory().server.process is None


def test_an_unknown_server_stops_the_run_before_it_writes_anything(tmp_path: Path) -> None:
    """A typo in --servers once overwrote the tracked default results on the way out."""
    out = tmp_path / "results"
    command = [sys.executable, str(BENCH), "--servers", "tritonllm,lama-q8_0", "--out", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "unknown ['lama-q8_0']" in result.stderr
    assert not out.exists()


def test_plot_draws_every_server_and_recomputes_summaries_from_raw(tmp_path: Path) -> None:
    """A run's PNG from its raw requests: summaries recomputed as the benchmark does (so older runs get
    ITL p99 and the longest gap), a value a server lacks left out rather than failing the plot, and a
    run of interleaved batch 1 alone draws its bars and marks the latency panels as not run."""
    from matplotlib.image import imread
    from peers.plot import draw, figure, resummarise

    stream = {"sent_s": 1.0, "max_tokens": 4, "chunks": [[1.5, 1], [2.0, 2], [2.5, 1]], "error": None}
    raw = {
        "tritonllm": {"b1": [stream], "c32": [stream], "mixed": [stream], "poisson": [stream]},
        "vllm-bf16": {"b1": [stream], "c32": [stream | {"max_tokens": 5}]},
    }
    meta = {
        "cpu_model": "AMD EPYC",
        "cores": 2,
        "cpu_flags": ["avx2", "avx512f"],
        "commit": "abc",
        "started": "x",
    }
    result = resummarise({"meta": meta, "weights": {"tritonllm": "int8", "vllm-bf16": "bf16"}}, raw)
    summaries = result["summaries"]
    one = summarise([RequestResult(1.0, 4, [(1.5, 1), (2.0, 2), (2.5, 1)])], True)
    assert summaries["tritonllm"]["b1"] == one
    assert summaries["tritonllm"]["c32"]["itl_max_ms"] == pytest.approx(500.0)
    assert summaries["vllm-bf16"]["c32"]["exact_lengths"] is False
    throughput, ttft, itl = draw(result).axes
    assert len(throughput.patches) == 4 + 2  # tritonllm's 4 workloads, vLLM's 2 (none for the others)
    assert len(ttft.patches) == 2 * 2 and len(itl.patches) == 3 * 3 + 3  # p50/p95; p95/p99/max
    assert "*" in "".join(t.get_text() for t in throughput.texts)  # vLLM's inexact c32
    assert imread(figure(result, tmp_path / "run.png")).shape[:2] == (550, 1760)  # 16 x 5 in, 110 dpi

    interleaved = {"tritonllm": {"b1x": one}, "llama-q8_0": {"b1x": one}}
    throughput, ttft, itl = draw({"summaries": interleaved}).axes
    assert len(throughput.patches) == 2 and not ttft.axison and not itl.axison


def test_interleaved_bursts_count_each_round_over_its_own_wall_time() -> None:
    """c32x: a round's rate is its tokens over its own wall time (not the time other servers had their turn
    in between: every round starts its clock at 0), the median of the rounds is the rate; latencies pool."""
    rounds = [
        [
            RequestResult(0.0, 2, [(0.5, 1), (1.0, 1)], round=0),
            RequestResult(0.0, 2, [(0.5, 1), (1.0, 1)], round=0),
        ],
        [RequestResult(0.0, 2, [(1.0, 1), (2.0, 1)], round=1)],  # 1 tok/s
        [RequestResult(0.0, 3, [(0.5, 3)], round=2), RequestResult(0.0, 3, [(0.5, 3)], round=2)],  # 12 tok/s
    ]
    results = [r for burst in rounds for r in burst]
    summary = summarise_rounds(results)
    assert summary["out_tok_s"] == pytest.approx(4.0)  # rounds at 4, 1 and 12 tok/s
    assert summarise(results, sequential=False)["out_tok_s"] == pytest.approx(12 / 2.0)  # what pooling gives
    assert summary["requests"] == 5 and summary["ttft_p95_ms"] == summarise(results, False)["ttft_p95_ms"]
    workload = interleaved_c32(vocab_size=1000, seed=0, scale=Scale(), rounds=3)
    assert len(workload.requests) == 3 * INTERLEAVED_ROUND_SIZE["c32x"] and not workload.sequential
    assert {(len(r.prompt_ids), r.max_tokens) for r in workload.requests} == {(128, 128)}


def test_cpu_busy_share_counts_idle_and_iowait_as_idle() -> None:
    """/proc/stat's aggregate line: user nice system idle iowait irq softirq steal guest guest_nice."""
    before = cpu_times("cpu  100 0 50 800 50 0 0 0 30 0\ncpu0 1 2 3\n")
    after = cpu_times("cpu  160 0 70 900 70 0 0 0 60 0\ncpu0 1 2 3\n")
    assert before == (150, 1000)
    assert busy_share(before, after) == pytest.approx(80 / 200)
    assert busy_share(after, after) == 0.0


def test_waiting_for_quiet_cpus_is_bounded() -> None:
    """Under a bound it returns at once on a quiet machine or at the bound on a busy one (max_busy -1:
    never quiet), never later than the bound plus one window."""
    waited = wait_until_quiet(max_busy=-1.0, window_s=0.02, timeout_s=0.1)
    assert 0.1 <= waited < 1.0
    assert wait_until_quiet(max_busy=1.0, window_s=0.02, timeout_s=5.0) < 1.0
