"""The `tritonllm-client` command line, run as a subprocess against the real server."""

from __future__ import annotations

import json

import pytest
from client_test_helpers import run_cli
from triton_fixture import free_ports
from tritonllm_client import Client, SamplingOptions

from tritonllm.triton.launcher import TritonServer

PROMPT = "Il était une fois"


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_generate_prints_the_streamed_text(triton_server: TritonServer, protocol: str) -> None:
    url = triton_server.grpc_url if protocol == "grpc" else triton_server.http_url
    with Client(url=url, protocol=protocol, model="tensorrt_llm_bls") as client:
        expected = client.generate(PROMPT, SamplingOptions(max_tokens=10, min_tokens=10)).text
    common = ["--url", url, "--protocol", protocol, "--model", "tensorrt_llm_bls", "--max-tokens", "10"]
    streamed = run_cli("generate", "--prompt", PROMPT, "--min-tokens", "10", *common)
    assert streamed.returncode == 0, streamed.stderr
    assert streamed.stdout == expected + "\n"
    assert "output tokens" in streamed.stderr and "finish: length" in streamed.stderr
    as_json = run_cli("generate", "--json", "--logprobs", *common, stdin=PROMPT)  # prompt from stdin
    assert as_json.returncode == 0, as_json.stderr
    record = json.loads(as_json.stdout)
    assert record["output_tokens"] == len(record["log_probs"]) > 0 and record["prompt_tokens"] > 0
    assert expected.startswith(record["text"])  # may stop early without --min-tokens


def test_chat_streams_one_reply_per_line(triton_server: TritonServer) -> None:
    with Client(url=triton_server.grpc_url) as client:
        replies = [
            client.generate(p, SamplingOptions(max_tokens=6, min_tokens=6), chat=True).text
            for p in ("hello", "how are you?")
        ]
    done = run_cli(
        "chat",
        "--url",
        triton_server.grpc_url,
        "--max-tokens",
        "6",
        "--min-tokens",
        "6",
        stdin="hello\n\nhow are you?\n",
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "".join(reply + "\n" for reply in replies)
    assert done.stderr.count("output tokens") == 2


def test_health(triton_server: TritonServer) -> None:
    for protocol, url in (("grpc", triton_server.grpc_url), ("http", triton_server.http_url)):
        ok = run_cli("health", "--url", url, "--protocol", protocol, "--model", "tensorrt_llm_bls")
        assert ok.returncode == 0, ok.stderr
        report = json.loads(ok.stdout)
        assert report["server_ready"] and report["model_ready"] and report["server"]["version"]
        assert report["model_metadata"]["name"] == "tensorrt_llm_bls"
    missing = run_cli("health", "--url", triton_server.grpc_url, "--model", "no_such_model")
    assert missing.returncode == 1 and "model 'no_such_model' is not ready" in missing.stderr


def test_clear_errors(triton_server: TritonServer) -> None:
    (port,) = free_ports(1)
    down = run_cli("generate", "--url", f"127.0.0.1:{port}", "--prompt", "hi", "--retries", "1")
    assert down.returncode == 1 and "ServerUnavailableError" in down.stderr and "Traceback" not in down.stderr
    unknown = run_cli("generate", "--url", triton_server.grpc_url, "--model", "nope", "--prompt", "hi")
    assert unknown.returncode == 1 and "ModelNotFoundError" in unknown.stderr and "'nope'" in unknown.stderr
    too_long = run_cli("generate", "--url", triton_server.grpc_url, "--prompt", "hi", "--max-tokens", "99999")
    assert too_long.returncode == 1 and "InvalidRequestError" in too_long.stderr
    assert "max_tokens" in too_long.stderr
    for bad in (["--top-p", "1.5"], ["--url", "nohost"]):
        invalid = run_cli("generate", "--prompt", "hi", *bad)
        assert invalid.returncode == 2 and "invalid option" in invalid.stderr, (bad, invalid.stderr)
    usage = run_cli("generate", "--protocol", "ftp")
    assert usage.returncode == 2 and "invalid choice" in usage.stderr
