"""gRPC streaming under Locust's gevent: why the locustfile calls ``grpc.experimental.gevent.init_gevent()``.

Runs in subprocesses (gevent monkey-patching must not leak into the pytest process). With init_gevent,
concurrent streams overlap and other greenlets keep running; without it, a stream read blocks the
gevent hub and the process hangs (here: killed at the deadline).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import json, sys, time
    from gevent import monkey
    monkey.patch_all()
    if sys.argv[2] == "init_gevent":
        import grpc.experimental.gevent
        grpc.experimental.gevent.init_gevent()
    import gevent
    from tritonllm_loadtest.transports import GrpcStreamTransport
    from tritonllm_loadtest.workload import GenerationRequest

    ticks = []
    def ticker():
        while True:
            gevent.sleep(0.002)
            ticks.append(time.perf_counter())
    def one(model):
        transport = GrpcStreamTransport(sys.argv[1], model, 60)
        return transport.generate(GenerationRequest("Once upon a time", 4, 24))
    tick = gevent.spawn(ticker)
    jobs = [gevent.spawn(one, m) for m in ("ensemble", "tensorrt_llm_bls") * 2]
    gevent.joinall(jobs, timeout=120)
    results = [job.value for job in jobs]
    print(json.dumps({
        "tokens": [r.output_tokens for r in results], "errors": [r.error_kind for r in results],
        "spans": [[r.start, r.end] for r in results], "ticks": ticks,
    }))
    """
)


def run_script(grpc_url: str, mode: str, timeout_s: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", SCRIPT, grpc_url, mode], capture_output=True, text=True, timeout=timeout_s
    )


def test_grpc_streams_are_concurrent_under_gevent_with_init_gevent(triton_server) -> None:
    done = run_script(triton_server.grpc_url, "init_gevent", timeout_s=180)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["tokens"] == [24] * 4 and out["errors"] == [None] * 4
    latest_start = max(start for start, _ in out["spans"])
    earliest_end = min(end for _, end in out["spans"])
    assert latest_start < earliest_end  # all four streams were in flight at once
    # Other greenlets kept running while each stream was read (a blocked hub stalls them for a whole
    # request). Counted, not timed: a loaded machine may delay ticks but not stop them. The ticker wakes
    # every 2 ms: at 10 ms a 24-token stream from today's engine (~90 ms) held as few as 3 in a CI run;
    # at 2 ms one held 38.
    for start, end in out["spans"]:
        inside = sum(start < tick < end for tick in out["ticks"])
        assert inside >= 5, f"{inside} ticks in a {1e3 * (end - start):.0f} ms stream"


def test_grpc_without_init_gevent_blocks_the_hub(triton_server) -> None:
    """Documents the failure the locustfile avoids: the same script hangs (bounded here by a timeout
    ~15x what the script takes with init_gevent, imports included)."""
    try:
        done = run_script(triton_server.grpc_url, "plain", timeout_s=8)
    except subprocess.TimeoutExpired:
        return
    out = json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else None
    raise AssertionError(f"expected a hang without init_gevent, got rc={done.returncode}: {out}")
