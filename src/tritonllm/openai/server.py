"""`tritonllm openai`: the command-line options and the server's run loop."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

from aiohttp import web

from tritonllm.openai.config import KEYS_ENV, FrontDoorConfig, load_keys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="model folder with the tokenizer (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--served-model-name", help="the `model` clients send (default: the folder's name)")
    parser.add_argument("--triton-url", default="127.0.0.1:8001", help="Triton's gRPC host:port")
    parser.add_argument(
        "--triton-model",
        default="tensorrt_llm_bls",
        help="the Triton model to call: tensorrt_llm_bls (text in and out; any Triton serving NVIDIA's "
        "contract), or this project's tensorrt_llm (token ids: the front door tokenizes and detokenizes "
        "itself, one hop fewer per token; `tritonllm launch --openai-port` uses it)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="listen address (default: loopback only)")
    parser.add_argument("--port", type=int, default=9000)
    parser.add_argument("--max-model-len", type=int, help="context length (default: the model's)")
    parser.add_argument(
        "--api-keys-file", help=f"JSON file of API keys, tiers and limits (also: ${KEYS_ENV}='key:tier,...')"
    )
    parser.add_argument(
        "--allow-anonymous",
        action="store_true",
        help="serve without API keys even beyond loopback (keys are required there by default)",
    )
    parser.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")


def config_from_args(args: argparse.Namespace) -> FrontDoorConfig:
    from tritonllm.default_model import model_path_or_default

    return FrontDoorConfig(
        tokenizer_dir=str(model_path_or_default(args.model)),
        triton_url=args.triton_url,
        triton_model=args.triton_model,
        served_model_name=args.served_model_name or "",
        host=args.host,
        port=args.port,
        max_model_len=args.max_model_len,
        request_timeout_s=args.request_timeout,
        keys=load_keys(args.api_keys_file, dict(os.environ)),
        require_keys=False if args.allow_anonymous else None,
    )


async def _serve(config: FrontDoorConfig) -> None:
    from tritonllm.openai.app import FrontDoor
    from tritonllm.tokenization import load_tokenizer

    door = FrontDoor(config, load_tokenizer(config.tokenizer_dir))
    # Handler cancellation: a client that disconnects cancels its request down to the engine.
    runner = web.AppRunner(door.app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, config.host, config.port).start()
    auth = f"API keys required ({len(config.keys.keys)})" if config.auth_required else "no API keys"
    print(
        f"tritonllm openai: http://{config.host}:{config.port}/v1 serving '{config.served_model_name}' "
        f"via {config.triton_model} at {config.triton_url} ({auth})",
        file=sys.stderr,
        flush=True,
    )
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop where it installs (Linux, macOS): its event loop thread spends ~9% less CPU per streamed
    request than asyncio's (benchmarks/README.md); asyncio's own loop elsewhere."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def run(config: FrontDoorConfig) -> int:
    """Serve until SIGINT/SIGTERM."""
    import logging
    import signal

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    loop = new_event_loop()
    task = loop.create_task(_serve(config))
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, task.cancel)
    try:
        loop.run_until_complete(task)
    except asyncio.CancelledError:
        pass
    finally:
        loop.close()
    return 0
