"""Resumable batch jobs: JSONL prompts in, JSONL results out, under the client's limits.

Input lines are objects with `prompt` and an optional unique `id` (default: the line number) and `chat`.
Each finished result is appended to the output as one line and fsync'ed before the job moves on, so a job
killed at any moment and run again with the same arguments skips what is recorded and does the rest:
nothing lost, no duplicates. Prompts that fail on their own (bad input, timeout, server error) go to
`<output>.failed.jsonl` with their error and are skipped on later runs unless `retry_failed` is set.
Server-wide failures (unreachable, breaker open, a generation aborted by a server shutting down) stop
the job instead: rerunning resumes it.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from tritonllm_client.client import AsyncClient
from tritonllm_client.errors import (
    CircuitOpenError,
    ClientError,
    InvalidOptionError,
    ServerError,
    ServerUnavailableError,
)
from tritonllm_client.options import SamplingOptions

# Errors that say the server, not the prompt, is the problem: stop the job, keep the prompt pending.
JOB_STOPPING_ERRORS = (ServerUnavailableError, CircuitOpenError)


@dataclass(frozen=True)
class BatchItem:
    id: str
    prompt: str
    chat: bool


@dataclass(frozen=True)
class BatchSummary:
    total: int
    already_done: int
    succeeded: int
    failed: int  # failed in this run
    skipped_failed: int  # failed earlier, not retried


def failed_path(output: Path) -> Path:
    return output.with_name(output.name + ".failed.jsonl")


def read_items(path: Path) -> list[BatchItem]:
    """Parse and check the whole input first: a bad line fails the job before anything is sent."""
    items, seen = [], set()
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise InvalidOptionError(f"{path}:{number}: not JSON: {exc}") from None
            if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
                raise InvalidOptionError(f'{path}:{number}: expected an object with a string "prompt"')
            item_id = str(record.get("id", number))
            if item_id in seen:
                raise InvalidOptionError(f"{path}:{number}: duplicate id {item_id!r}")
            seen.add(item_id)
            items.append(BatchItem(item_id, record["prompt"], bool(record.get("chat", False))))
    return items


class JsonlLog:
    """Append-only JSONL file: one `write` per record, fsync'ed; a torn last line is dropped on open."""

    def __init__(self, path: Path):
        self.path = path
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        self._drop_torn_tail()

    def _drop_torn_tail(self) -> None:
        size = os.fstat(self.fd).st_size
        if size == 0 or os.pread(self.fd, 1, size - 1) == b"\n":  # intact: no need to read it all
            return
        data = os.pread(self.fd, size, 0)
        keep = data.rfind(b"\n") + 1
        if keep != size:
            os.ftruncate(self.fd, keep)
            os.fsync(self.fd)

    def records(self) -> Iterator[dict[str, Any]]:
        size = os.fstat(self.fd).st_size
        for line in os.pread(self.fd, size, 0).splitlines():
            if line.strip():
                yield json.loads(line)

    def append(self, record: dict[str, Any]) -> None:
        os.write(self.fd, (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8"))
        os.fsync(self.fd)

    def close(self) -> None:
        os.close(self.fd)


def _lock(log: JsonlLog) -> None:
    try:
        fcntl.flock(log.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise ClientError(f"another batch job is writing {log.path}") from None


def _fsync_dir(path: Path) -> None:
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


async def run_batch(
    client: AsyncClient,
    input_path: Path,
    output_path: Path,
    options: SamplingOptions,
    *,
    retry_failed: bool = False,
    progress: bool = True,
) -> BatchSummary:
    """Run (or resume) a job; at most `client.config.max_concurrency` prompts are in flight."""
    items = read_items(input_path)
    results, failures = JsonlLog(output_path), JsonlLog(failed_path(output_path))
    try:
        _lock(results)
        _fsync_dir(output_path)
        done = {str(r["id"]) for r in results.records()}
        failed_before = {str(r["id"]) for r in failures.records()} - done
        skip = done if retry_failed else done | failed_before
        pending = [item for item in items if item.id not in skip]
        counts = {"ok": 0, "failed": 0}
        bar = tqdm(total=len(items), initial=len(items) - len(pending), disable=not progress, unit="prompt")

        async def run_one(item: BatchItem) -> None:
            try:
                result = await client.generate(item.prompt, options, chat=item.chat)
                if result.finish_reason == "abort":  # not ours: the server aborted it (draining to stop)
                    raise ServerUnavailableError(f"the server aborted prompt {item.id!r}; rerun the job")
                if result.finish_reason in ("error", "timeout"):
                    raise ServerError(f"generation ended with finish_reason={result.finish_reason!r}")
            except JOB_STOPPING_ERRORS:
                raise
            except ClientError as exc:
                failures.append({"id": item.id, "error": str(exc), "error_type": type(exc).__name__})
                counts["failed"] += 1
            else:
                results.append({"id": item.id, **result.to_json()})
                counts["ok"] += 1
            bar.update(1)

        await _run_bounded(run_one, pending, client.config.max_concurrency)
        bar.close()
        return BatchSummary(
            total=len(items),
            already_done=len(done),
            succeeded=counts["ok"],
            failed=counts["failed"],
            skipped_failed=0 if retry_failed else len(failed_before),
        )
    finally:
        results.close()
        failures.close()


async def _run_bounded(run_one: Any, items: list[BatchItem], limit: int) -> None:
    """At most `limit` tasks alive (not one task per prompt up front); the first job-stopping error wins."""
    queue = iter(items)
    running: set[asyncio.Task] = set()
    try:
        while True:
            while len(running) < limit and (item := next(queue, None)) is not None:
                running.add(asyncio.create_task(run_one(item)))
            if not running:
                return
            finished, running = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
            for task in finished:
                task.result()  # re-raises a job-stopping error
    finally:
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
