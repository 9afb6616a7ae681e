"""The `tensorrt_llm` model: the engine (the project's, or TensorRT-LLM's executor) behind Triton."""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from tritonllm.engine.config import EngineConfig
from tritonllm.engine.serving import ServingEngine
from tritonllm.engine_format import engine_backend, engine_defaults
from tritonllm.triton import tensors
from tritonllm.triton.bridge import EngineBridge
from tritonllm.triton.models import recovery
from tritonllm.triton.models.common import (
    SenderChannel,
    is_decoupled,
    model_parameters,
    pb_utils,
    request_inputs,
    request_parameters,
    request_timeout_us,
)
from tritonllm.triton.options import DEFAULT_MAX_ENGINE_RESTARTS, DEFAULT_SEND_STALL_TIMEOUT_S
from tritonllm.triton.tensors import RequestError

log = logging.getLogger(__name__)


def engine_config(params: dict[str, str]) -> EngineConfig:
    """EngineConfig from the `tensorrt_llm` model's config.pbtxt parameters.

    `engine_dir` is a HF checkpoint or an engine directory from `build_engines/build.py`, whose limits
    (and quantization) fill the parameters left empty; the engine's own defaults fill the rest.
    """
    ints = (
        "tokens_per_block",
        "num_kv_blocks",
        "kv_cache_memory_bytes",
        "max_model_len",
        "max_num_seqs",
        "max_num_batched_tokens",
        "max_waiting",
        "num_threads",
        "seed",
    )
    kwargs: dict[str, Any] = {"model": params["engine_dir"], **engine_defaults(params["engine_dir"])}
    for name in ints:
        if params.get(name, "").strip():
            kwargs[name] = int(params[name])
    for name in ("dtype", "device", "quantization", "kv_cache_dtype"):
        if params.get(name, "").strip():
            kwargs[name] = params[name].strip()
    if params.get("enable_prefix_caching", "").strip():
        kwargs["enable_prefix_caching"] = params["enable_prefix_caching"].strip().lower() != "false"
    return EngineConfig(**kwargs)


class EngineModel:
    """The `tensorrt_llm` model over the project's engine: decoupled (streaming) or not."""

    def initialize(self, args: dict[str, str]) -> None:
        self.pb = pb_utils()
        config = json.loads(args["model_config"])
        self.decoupled = is_decoupled(self.pb, config)
        params = model_parameters(config)
        self.drain_timeout_s = float(params.get("drain_timeout_s") or 5.0)
        if params.get("disable_kernels", "").lower() == "true":  # the stub does not inherit the environment
            os.environ["TRITONLLM_DISABLE_KERNELS"] = "1"
        from tritonllm.triton.metrics import MetricsReporter

        engine_cfg = engine_config(params)
        if engine_backend(engine_cfg.model) == "tensorrt_llm":  # an engine dir built by TensorRT-LLM
            from tritonllm.engine.trtllm_executor import TrtllmEngine, settings_from_parameters

            engine = TrtllmEngine(engine_cfg.model, settings_from_parameters(engine_cfg.model, params))
        else:
            engine = ServingEngine(engine_cfg)
        self.metrics = MetricsReporter(self.pb, engine, labels={"model": args["model_name"]})
        self.bridge = EngineBridge(
            engine_cfg,
            on_finished=self.metrics.record_finished,
            on_rejected=self.metrics.record_rejected,
            engine=engine,
            decoupled=self.decoupled,
            stream_interval=int(params.get("stream_interval") or 1),
        )
        # A dead engine loop: reload this model (a new engine), or stop the server (`recovery`).
        limit = int(params.get("max_engine_restarts") or DEFAULT_MAX_ENGINE_RESTARTS)
        # A send that never returns (a dead BLS caller): stop the server (`recovery`).
        self.watchdog = recovery.EngineWatchdog(
            engine,
            lambda: recovery.recover(self.pb, args["model_name"], config, engine, limit),
            stalled_s=self.bridge.sender_stalled_s,
            stall_limit_s=float(params.get("send_stall_timeout_s") or DEFAULT_SEND_STALL_TIMEOUT_S),
        )

    def execute(self, requests: list[Any]) -> None:
        for request in requests:
            try:
                channel = SenderChannel(self.pb, request, self.decoupled)
            except Exception:
                log.exception("no response sender")
                continue
            try:
                params = request_parameters(request)
                timeout_us = request_timeout_us(request, params)
                rows = self.parse(request, params.get("priority"))
                self.bridge.submit(request.request_id(), rows, channel, timeout_s=timeout_us / 1e6 or None)
            except RequestError as exc:
                channel.send(None, str(exc), final=True)
            except Exception as exc:
                log.exception("tensorrt_llm execute failed")
                channel.send(None, f"internal error: {exc}", final=True)
        return None

    def parse(self, request: Any, priority: object = None) -> list[tensors.EngineRequest]:
        """One EngineRequest per batch row (a `stop` request is one row), at the priority parameter given."""
        inputs = request_inputs(request)
        if tensors.is_stop(inputs):
            return [tensors.parse_engine_request(tensors.split_batch(inputs)[0])]
        rows = [tensors.parse_engine_request(row, priority) for row in tensors.split_batch(inputs)]
        if not self.decoupled and any(r.streaming for r in rows):
            raise RequestError("streaming", "needs the decoupled model (tritonllm launch --decoupled true)")
        return rows

    def finalize(self) -> None:
        self.watchdog.close()
        self.bridge.shutdown(self.drain_timeout_s)
        self.metrics.close()
