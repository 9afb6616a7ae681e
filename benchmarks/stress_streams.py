"""Many concurrent SSE streams against one model of a running server, some cut off mid-stream.

Reproduced the `tensorrt_llm_bls` stub crash of Triton 2.51's BLS calls, and checks the gRPC path that
replaced them (benchmarks/README.md, "BLS stub crash"): workers each send one streamed request after
another (8-200 exact output tokens) and disconnect from a `--cut` share of them after a few events. A
worker stops at its first failed request, so a dead model shows as `failed` equal to the number of
workers. Prints the counts every 10 s and at the end.

    .venv/bin/tritonllm launch &     # then:
    .venv/bin/python benchmarks/stress_streams.py --model tensorrt_llm_bls --workers 8 --seconds 120
    .venv/bin/python benchmarks/stress_streams.py --url http://127.0.0.1:9000 --openai SmolLM2-135M-Instruct
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import threading
import time
from collections import Counter

import requests


def is_error(event: bytes) -> bool:
    """An SSE event that carries an error (Triton's `{"error": ...}`, the front door's the same)."""
    if not event.startswith(b"data: {"):
        return False
    try:
        return "error" in json.loads(event[len(b"data: ") :])
    except ValueError:
        return True


def worker(
    url: str,
    openai_model: str | None,
    seed: int,
    cut_share: float,
    deadline: float,
    counts: Counter,
    lock: threading.Lock,
) -> None:
    rng = random.Random(seed)
    while time.monotonic() < deadline:
        n = rng.randint(8, 200)
        body: dict = {"max_tokens": n, "min_tokens": n, "stream": True}
        if openai_model:
            body |= {"model": openai_model, "prompt": f"Story {rng.random()}"}
        else:
            body["text_input"] = f"Story {rng.random()}"
        cut = rng.random() < cut_share
        try:
            with requests.post(url, json=body, stream=True, timeout=120) as response:
                response.raise_for_status()
                lines = response.iter_lines()
                events = list(itertools.islice(lines, rng.randint(1, 20))) if cut else [e for e in lines if e]
            complete = bool(events) and (not openai_model or events[-1] == b"data: [DONE]")
            ok = complete and not any(is_error(e) for e in events)
            outcome = "cut" if cut else "done" if ok else "failed"
            detail = events[-3:]
        except requests.RequestException as exc:
            outcome, detail = "failed", [repr(exc)]
        if outcome == "failed":
            print(f"failed: {detail}", flush=True)
        with lock:
            counts[outcome] += 1
        if outcome == "failed":
            return


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default="tensorrt_llm_bls")
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=120.0)
    parser.add_argument("--cut", type=float, default=0.3, help="share of streams cut off mid-stream")
    parser.add_argument(
        "--openai", metavar="MODEL", help="stream completions of MODEL from an OpenAI front door at --url"
    )
    args = parser.parse_args()
    url = f"{args.url}/v2/models/{args.model}/generate_stream"
    if args.openai:
        url = f"{args.url}/v1/completions"
    deadline = time.monotonic() + args.seconds
    counts: Counter = Counter()
    lock = threading.Lock()
    threads = [
        threading.Thread(
            target=worker, args=(url, args.openai, i, args.cut, deadline, counts, lock), daemon=True
        )
        for i in range(args.workers)
    ]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        for t in threads:
            t.join(10.0 / len(threads))
        with lock:
            print(dict(counts), flush=True)
    return 1 if counts["failed"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
