"""Resumable batch jobs: SIGKILLed mid-run several times, then resumed complete and duplicate-free."""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

import pytest
from client_test_helpers import CLI, run_cli, wait_for
from tritonllm_client import Client, InvalidOptionError, SamplingOptions
from tritonllm_client.batch import JsonlLog, failed_path, read_items

from tritonllm.triton.launcher import TritonServer

PROMPTS = 40
OPTIONS = ["--max-tokens", "8", "--min-tokens", "8", "--concurrency", "4", "--no-progress"]


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_killed_batch_job_resumes_complete_without_duplicates(
    triton_server: TritonServer, tmp_path: Path
) -> None:
    inputs, output = tmp_path / "prompts.jsonl", tmp_path / "results.jsonl"
    prompts = {f"p{i}": f"Prompt number {i} says" for i in range(PROMPTS)}
    inputs.write_text("".join(json.dumps({"id": k, "prompt": v}) + "\n" for k, v in prompts.items()))
    # 10 prompts/s: the job takes ~4 s, so each kill lands mid-run.
    command = [
        *CLI,
        "batch",
        str(inputs),
        str(output),
        "--url",
        triton_server.grpc_url,
        "--rate",
        "10",
        *OPTIONS,
    ]
    for kill_after in (5, 12, 20):
        job = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            assert wait_for(
                lambda n=kill_after, j=job: len(lines(output)) >= n or j.poll() is not None, timeout_s=60
            )
            job.send_signal(signal.SIGKILL)
        finally:
            job.wait(timeout=30)
        assert job.returncode == -signal.SIGKILL, job.stderr.read() if job.stderr else ""
        assert kill_after <= len(lines(output)) < PROMPTS  # killed mid-run, after progress
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stderr.strip().splitlines()[-1])
    assert summary["total"] == PROMPTS and summary["already_done"] + summary["succeeded"] == PROMPTS
    records = lines(output)
    ids = [r["id"] for r in records]
    assert sorted(ids) == sorted(prompts) and len(ids) == len(set(ids))  # complete, no duplicates
    with Client(url=triton_server.grpc_url) as client:
        for record in records[:: PROMPTS // 8]:
            expected = client.generate(prompts[record["id"]], SamplingOptions(max_tokens=8, min_tokens=8))
            assert record["text"] == expected.text and record["output_tokens"] == 8
    again = run_cli("batch", str(inputs), str(output), "--url", triton_server.grpc_url, *OPTIONS)
    assert again.returncode == 0 and json.loads(again.stderr.strip().splitlines()[-1])["succeeded"] == 0
    assert len(lines(output)) == PROMPTS


def test_failed_prompts_are_recorded_and_retried_on_request(
    triton_server: TritonServer, tmp_path: Path
) -> None:
    inputs, output = tmp_path / "prompts.jsonl", tmp_path / "results.jsonl"
    records = [{"id": "ok", "prompt": "hello"}, {"id": "too-long", "prompt": "fox " * 600, "chat": True}]
    inputs.write_text("".join(json.dumps(r) + "\n" for r in records))
    args = ("batch", str(inputs), str(output), "--url", triton_server.grpc_url, *OPTIONS)
    first = run_cli(*args)
    assert first.returncode == 3, first.stderr  # finished, with failures
    assert [r["id"] for r in lines(output)] == ["ok"]
    failures = lines(failed_path(output))
    assert [f["id"] for f in failures] == ["too-long"] and failures[0]["error_type"] == "InvalidRequestError"
    assert "input_ids" in failures[0]["error"] or "max_tokens" in failures[0]["error"]
    skipped = run_cli(*args)
    assert json.loads(skipped.stderr.strip().splitlines()[-1])["skipped_failed"] == 1
    assert len(lines(failed_path(output))) == 1  # not retried without --retry-failed
    retried = run_cli(*args, "--retry-failed")
    assert json.loads(retried.stderr.strip().splitlines()[-1])["failed"] == 1
    assert len(lines(failed_path(output))) == 2 and len(lines(output)) == 1


def test_bad_input_file_fails_before_sending(tmp_path: Path) -> None:
    inputs = tmp_path / "prompts.jsonl"
    inputs.write_text('{"id": 1, "prompt": "a"}\n{"id": 1, "prompt": "b"}\n')
    duplicate = run_cli("batch", str(inputs), str(tmp_path / "out.jsonl"), "--url", "127.0.0.1:1")
    assert duplicate.returncode == 2 and "duplicate id '1'" in duplicate.stderr
    for text, error in (('{"text": "no prompt"}\n', 'string "prompt"'), ("{not json\n", "not JSON")):
        inputs.write_text(text)
        with pytest.raises(InvalidOptionError, match=error):
            read_items(inputs)


def test_torn_last_line_is_dropped_on_resume(tmp_path: Path) -> None:
    path = tmp_path / "log.jsonl"
    path.write_bytes(b'{"id": "a"}\n{"id": "b"}\n{"id": "c", "te')  # killed mid-write
    log = JsonlLog(path)
    try:
        assert [r["id"] for r in log.records()] == ["a", "b"]
        log.append({"id": "c"})
    finally:
        log.close()
    assert path.read_text() == '{"id": "a"}\n{"id": "b"}\n{"id": "c"}\n'
