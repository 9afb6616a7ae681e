"""A built engine directory served by the real Triton server, without the checkpoint it was built from."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import requests
import triton_fixture
from build_engine_helpers import build_without_source
from engine_helpers import make_engine
from triton_fixture import start_server, tiny_server_options

from tritonllm.engine import SamplingParams
from tritonllm.triton.text import CONTEXT_TOKENS, TextCodec

PROMPTS = ["The quick brown fox", "A paged key-value cache"]
MAX_TOKENS = 10


def engine_text(engine_dir: Path, prompt: str) -> str:
    """Greedy output of the project's engine on the engine dir, decoded like postprocessing does."""
    codec = TextCodec(str(engine_dir))
    engine = make_engine(engine_dir, num_kv_blocks=512)
    ids = codec.encode(prompt)
    engine.add_request(uuid.uuid4().hex, ids, SamplingParams(max_tokens=MAX_TOKENS, top_k=1))
    tokens: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_token_ids
    return codec.delta(ids[-CONTEXT_TOKENS:], tokens)


@pytest.fixture(scope="module")
def int8_engine_dir(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_without_source(tiny_llama_dir, tmp_path_factory.mktemp("served"), ["int8_wo"])["int8_wo"]


def test_triton_serves_an_int8_engine_dir(
    int8_engine_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Four Python stubs importing torch took over 3 minutes to start on a 2-core machine shared with
    # other test runs (load average ~13); a quiet one needs 30-60 s.
    monkeypatch.setattr(triton_fixture, "READY_TIMEOUT_S", 420.0)
    server = start_server(tiny_server_options(int8_engine_dir), tmp_path / "tritonserver.log")
    try:
        for prompt in PROMPTS:
            r = requests.post(
                f"http://{server.http_url}/v2/models/ensemble/generate",
                json={"text_input": prompt, "max_tokens": MAX_TOKENS, "exclude_input_in_output": True},
                timeout=120,
            )
            assert r.status_code == 200, r.text
            assert r.json()["text_output"] == engine_text(int8_engine_dir, prompt)
    finally:
        server.stop(timeout_s=30)
