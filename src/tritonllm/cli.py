"""Command line: `tritonllm launch` serves a model on Triton Inference Server; `tritonllm generate`
streams one completion and `tritonllm serve` chats on the terminal, both on the engine in-process.
"""

from __future__ import annotations

import argparse
import sys
import uuid

from tritonllm.engine import EngineConfig, SamplingParams
from tritonllm.engine.serving import ServingEngine
from tritonllm.precision import DTYPES, ENGINE_QUANTIZATIONS, KV_CACHE_DTYPES
from tritonllm.tokenization import IncrementalDetokenizer, encode_prompt, load_tokenizer


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="HF checkpoint directory (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int)
    parser.add_argument(
        "--quantization",
        choices=ENGINE_QUANTIZATIONS,
        default="auto",
        help="default auto: as built, else int8 where the CPU kernels run, else none",
    )
    parser.add_argument(
        "--dtype", choices=DTYPES, default="auto", help="default: the fastest for this machine"
    )
    parser.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default="auto",
        help="default auto: as built, else the compute dtype (bf16 under int8/int7/int4); int8: a scale "
        "per row",
    )
    parser.add_argument("--threads", type=int, help="CPU threads (default: the cores available)")


def _stream(engine: ServingEngine, tokenizer, prompt_ids: list[int], params: SamplingParams) -> None:
    detok = IncrementalDetokenizer(tokenizer, context_ids=prompt_ids)
    stream = engine.submit(uuid.uuid4().hex, prompt_ids, params)
    try:
        for out in stream.outputs():
            sys.stdout.write(detok.push(out.new_token_ids))
            sys.stdout.flush()
    except KeyboardInterrupt:
        engine.cancel(stream.request_id)
    sys.stdout.write(detok.flush() + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tritonllm", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="stream one completion of --prompt")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--chat", action="store_true", help="apply the chat template")
    _add_common(gen)
    serve = sub.add_parser("serve", help="interactive chat with the engine (one prompt per line)")
    _add_common(serve)
    from tritonllm.triton.launcher import launch
    from tritonllm.triton.options import add_arguments, options_from_args

    add_arguments(
        sub.add_parser("launch", help="serve the model on Triton Inference Server (HTTP, gRPC, metrics)")
    )
    from tritonllm.openai import server as openai_server

    openai_server.add_arguments(
        sub.add_parser("openai", help="OpenAI-compatible API in front of a Triton server (gRPC)")
    )
    args = parser.parse_args(argv)
    if args.command == "launch":
        return launch(options_from_args(args), ready_timeout_s=args.ready_timeout)
    if args.command == "openai":
        return openai_server.run(openai_server.config_from_args(args))

    from tritonllm.default_model import model_path_or_default

    path = model_path_or_default(args.model)
    tokenizer = load_tokenizer(path)
    engine = ServingEngine(
        EngineConfig(
            model=path,
            dtype=args.dtype,
            quantization=args.quantization,
            kv_cache_dtype=args.kv_cache_dtype,
            num_threads=args.threads,
        )
    )
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
    )
    try:
        if args.command == "generate":
            _stream(engine, tokenizer, encode_prompt(tokenizer, args.prompt, args.chat), params)
            return 0
        print(f"tritonllm: chatting with {path} (Ctrl-D to quit, Ctrl-C stops a reply)", file=sys.stderr)
        for line in sys.stdin:
            if line.strip():
                _stream(engine, tokenizer, encode_prompt(tokenizer, line.strip(), chat=True), params)
        return 0
    finally:
        engine.shutdown()


if __name__ == "__main__":
    sys.exit(main())
