"""`tritonllm-client`: generate (streamed), chat (interactive), batch (resumable JSONL job), health."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

from tritonllm_client.batch import run_batch
from tritonllm_client.client import AsyncClient
from tritonllm_client.errors import ClientError, InvalidOptionError
from tritonllm_client.options import (
    PROTOCOLS,
    BreakerPolicy,
    ClientConfig,
    RateLimit,
    RetryPolicy,
    SamplingOptions,
)


def _add_connection(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("server")
    group.add_argument("--url", help="host:port (default localhost:8001 for grpc, localhost:8000 for http)")
    group.add_argument("--protocol", choices=PROTOCOLS, default="grpc")
    group.add_argument("--model", default="ensemble", help="ensemble or tensorrt_llm_bls (default ensemble)")
    group.add_argument("--timeout", type=float, default=120.0, help="seconds per request (default 120)")
    group.add_argument("--retries", type=int, default=4, help="attempts for unavailable/busy errors")


def _add_sampling(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int, default=64)
    group.add_argument("--temperature", type=float)
    group.add_argument("--top-k", type=int)
    group.add_argument("--top-p", type=float)
    group.add_argument("--repetition-penalty", type=float)
    group.add_argument("--presence-penalty", type=float)
    group.add_argument("--frequency-penalty", type=float)
    group.add_argument("--min-tokens", type=int)
    group.add_argument("--seed", type=int)
    group.add_argument("--end-id", type=int)
    group.add_argument("--priority", type=int, help="lower is served first (server default 0)")
    group.add_argument("--stop", action="append", default=[], help="stop word (repeatable)")
    group.add_argument("--logprobs", action="store_true", help="return per-token log-probabilities")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tritonllm-client", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    generate = commands.add_parser("generate", help="generate from one prompt, printing as it streams")
    generate.add_argument("--prompt", help="the prompt (default: read stdin)")
    generate.add_argument("--chat", action="store_true", help="apply the model's chat template")
    generate.add_argument("--no-stream", action="store_true", help="one response instead of streaming")
    generate.add_argument("--json", action="store_true", help="print the result as JSON (text and stats)")

    commands.add_parser("chat", help="interactive: each line is a user turn, the reply is streamed")

    batch = commands.add_parser("batch", help="resumable JSONL batch job")
    batch.add_argument("input", type=Path, help='JSONL: {"prompt": ..., "id": optional, "chat": optional}')
    batch.add_argument("output", type=Path, help="JSONL results (appended; failures in OUTPUT.failed.jsonl)")
    batch.add_argument("--concurrency", type=int, default=8, help="requests in flight (default 8)")
    batch.add_argument("--rate", type=float, help="client-side rate limit per second")
    batch.add_argument("--burst", type=float, default=1.0, help="rate limiter burst (default 1)")
    batch.add_argument("--rate-unit", choices=("requests", "tokens"), default="requests")
    batch.add_argument("--retry-failed", action="store_true", help="run prompts that failed before again")
    batch.add_argument("--no-progress", action="store_true")

    commands.add_parser("health", help="server and model readiness and metadata (exit 1 if not ready)")

    for name, sub in commands.choices.items():
        _add_connection(sub)
        if name in ("generate", "chat", "batch"):
            _add_sampling(sub)
    return parser


def _config(args: argparse.Namespace) -> ClientConfig:
    rate = getattr(args, "rate", None)
    return ClientConfig(
        url=args.url,
        protocol=args.protocol,
        model=args.model,
        request_timeout_s=args.timeout,
        max_concurrency=getattr(args, "concurrency", 1),
        rate_limit=RateLimit(rate=rate, burst=args.burst, unit=args.rate_unit) if rate is not None else None,
        retry=RetryPolicy(attempts=args.retries),
        breaker=BreakerPolicy(failures=max(5, args.retries + 1)),
        count_prompt_tokens=True,
    )


def _sampling(args: argparse.Namespace) -> SamplingOptions:
    return SamplingOptions(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        min_tokens=args.min_tokens,
        seed=args.seed,
        end_id=args.end_id,
        priority=args.priority,
        stop_words=tuple(args.stop),
        return_log_probs=args.logprobs,
    )


def _stats(result: Any) -> str:
    return (
        f"[{result.prompt_tokens} prompt + {result.output_tokens} output tokens,"
        f" finish: {result.finish_reason}, TTFT {result.ttft_s * 1000:.1f} ms, "
        f"{result.tokens_per_s:.1f} tok/s]"
    )


async def _print_stream(client: AsyncClient, prompt: str, options: SamplingOptions, chat: bool) -> Any:
    generation = client.stream(prompt, options, chat=chat)
    async for chunk in generation:
        sys.stdout.write(chunk.text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return generation.result


async def _generate(client: AsyncClient, args: argparse.Namespace) -> int:
    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    options = _sampling(args)
    if args.json or args.no_stream:
        result = await client.generate(prompt, options, chat=args.chat, stream=not args.no_stream)
        print(json.dumps(result.to_json(), ensure_ascii=False) if args.json else result.text)
    else:
        result = await _print_stream(client, prompt, options, args.chat)
    print(_stats(result), file=sys.stderr)
    return 0


async def _chat(client: AsyncClient, args: argparse.Namespace) -> int:
    options = _sampling(args)
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            print("> ", end="", file=sys.stderr, flush=True)
        line = await asyncio.to_thread(sys.stdin.readline)
        if not line:
            return 0
        if line.strip():
            result = await _print_stream(client, line.strip(), options, chat=True)
            print(_stats(result), file=sys.stderr)


async def _batch(client: AsyncClient, args: argparse.Namespace) -> int:
    summary = await run_batch(
        client,
        args.input,
        args.output,
        _sampling(args),
        retry_failed=args.retry_failed,
        progress=not args.no_progress,
    )
    print(json.dumps(summary.__dict__), file=sys.stderr)
    return 0 if summary.failed == 0 and summary.skipped_failed == 0 else 3


async def _health(client: AsyncClient, args: argparse.Namespace) -> int:
    report = await client.health()
    print(json.dumps(report, indent=2))
    if not report["model_ready"]:
        print(f"error: model {args.model!r} is not ready on {report['url']}", file=sys.stderr)
    return 0 if report["server_ready"] and report["model_ready"] else 1


COMMANDS = {"generate": _generate, "chat": _chat, "batch": _batch, "health": _health}


async def _main(args: argparse.Namespace) -> int:
    async with AsyncClient(_config(args)) as client:
        return await COMMANDS[args.command](client, args)


def main(argv: list[str] | None = None) -> int:
    """Exit codes: 0 ok, 1 error, 2 invalid usage, 3 batch finished with failed prompts."""
    args = build_parser().parse_args(argv)
    try:
        if args.command in ("generate", "chat", "batch"):
            _sampling(args)  # invalid options fail before connecting
        return asyncio.run(_main(args))
    except InvalidOptionError as exc:
        print(f"error: invalid option: {exc}", file=sys.stderr)
        return 2
    except ClientError as exc:
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
