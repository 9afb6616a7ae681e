"""Guided decoding through the real Triton server: NVIDIA's `guided_decoding_guide_type` and
`guided_decoding_guide` inputs on `ensemble`, `tensorrt_llm_bls` and `tensorrt_llm`."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import numpy as np
import pytest
from test_server import MODELS, engine_stream, grpc_generate, http_generate

from tritonllm.triton.launcher import TritonServer
from tritonllm.triton.tensors import RequestError, parse_engine_request
from tritonllm.triton.text import TextCodec

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]}},
    "required": ["ok", "color"],
    "additionalProperties": False,
}
REGEX = r"(yes|no)-[0-9]{2,3}"
EBNF = 'root ::= ("yes" | "no") " " [0-9] [0-9]'


def _string(value: str) -> np.ndarray:
    return np.array([[value.encode()]], dtype=object)


def test_guide_tensors_reach_sampling_params_and_bad_ones_name_the_tensor() -> None:
    base = {"input_ids": np.array([[5, 6]], dtype=np.int32), "request_output_len": np.array([[4]], np.int32)}
    guide = {"guided_decoding_guide_type": _string("regex"), "guided_decoding_guide": _string("[0-9]+")}
    params = parse_engine_request(base | guide).params
    assert (params.guided_decoding_guide_type, params.guided_decoding_guide) == ("regex", "[0-9]+")
    assert not parse_engine_request(base | {"guided_decoding_guide_type": _string("")}).params.guided
    with pytest.raises(RequestError, match="'guided_decoding_guide'.*unclosed") as info:
        parse_engine_request(base | guide | {"guided_decoding_guide": _string("[0-9")})
    assert info.value.for_ensemble().tensor == "guided_decoding_guide"
    with pytest.raises(RequestError, match="'guided_decoding_guide_type'.*must be one of"):
        parse_engine_request(base | guide | {"guided_decoding_guide_type": _string("yaml")})


@pytest.mark.parametrize("model", MODELS)
def test_guided_generate_over_http(triton_server: TritonServer, model: str) -> None:
    checks = {
        "regex": (REGEX, lambda text: re.fullmatch(REGEX, text)),
        "ebnf_grammar": (EBNF, lambda text: re.fullmatch("(yes|no) [0-9][0-9]", text)),
        "json_schema": (
            json.dumps(SCHEMA),
            lambda text: jsonschema.validate(json.loads(text), SCHEMA) or True,
        ),
    }
    for prompt in ("The quick brown fox", "A paged key-value cache"):
        for guide_type, (guide, matches) in checks.items():
            body = {
                "text_input": prompt,
                "max_tokens": 48,
                "exclude_input_in_output": True,
                "guided_decoding_guide_type": guide_type,
                "guided_decoding_guide": guide,
            }
            r = http_generate(triton_server, model, body)
            assert r.status_code == 200, r.text
            assert matches(r.json()["text_output"]), (guide_type, r.json())


@pytest.mark.parametrize("model", MODELS)
def test_bad_guides_fail_alone_naming_the_tensor(triton_server: TritonServer, model: str) -> None:
    bad = [
        ({"guided_decoding_guide_type": "regex", "guided_decoding_guide": "[0-9"}, "guided_decoding_guide"),
        (
            {"guided_decoding_guide_type": "json_schema", "guided_decoding_guide": "{"},
            "guided_decoding_guide",
        ),
        (
            {"guided_decoding_guide_type": "yaml", "guided_decoding_guide": "a: 1"},
            "guided_decoding_guide_type",
        ),
    ]
    for extra, tensor in bad:
        r = http_generate(triton_server, model, {"text_input": "hi", "max_tokens": 8, **extra})
        assert r.status_code == 400, r.text
        assert f"'{tensor}'" in r.json()["error"], r.text
    ok = http_generate(triton_server, model, {"text_input": "hi", "max_tokens": 4})
    assert ok.status_code == 200, ok.text


def test_streamed_bls_and_direct_engine_follow_the_grammar(
    triton_server: TritonServer, tiny_llama_dir: Path
) -> None:
    texts, error = grpc_generate(
        triton_server,
        "tensorrt_llm_bls",
        {
            "text_input": "Triton Inference Server runs models",
            "max_tokens": 48,
            "stream": True,
            "guided_decoding_guide_type": "regex",
            "guided_decoding_guide": REGEX,
        },
    )
    assert error is None and len(texts) > 1 and re.fullmatch(REGEX, "".join(texts)), texts
    guide = {"guided_decoding_guide_type": "json_schema", "guided_decoding_guide": json.dumps(SCHEMA)}
    stream = engine_stream(
        triton_server,
        "guided-direct",
        {"input_lengths": 5, "request_output_len": 48, "streaming": True, **guide},
    )
    try:
        tokens = []
        for outputs, err in stream.responses():
            assert err is None, err
            tokens += (
                outputs["output_ids"].reshape(-1)[: int(outputs["sequence_length"].reshape(-1)[0])].tolist()
            )
    finally:
        stream.close()
    jsonschema.validate(json.loads(TextCodec(tiny_llama_dir).decode(tokens)), SCHEMA)
