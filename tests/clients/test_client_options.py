"""Option validation and error classification (no server needed)."""

from __future__ import annotations

import pytest
from tritonllm_client import (
    ClientConfig,
    InvalidOptionError,
    InvalidRequestError,
    ModelNotFoundError,
    RateLimit,
    RetryPolicy,
    SamplingOptions,
    ServerBusyError,
    ServerError,
    ServerUnavailableError,
)
from tritonllm_client.errors import classify


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 2**31}, "top_k"),  # INT32 on the wire: no silent overflow
        ({"max_tokens": 2**31}, "max_tokens"),
        ({"top_p": 1.5}, "top_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3.0}, "frequency_penalty"),
        ({"max_tokens": 4, "min_tokens": 5}, "min_tokens"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**64}, "seed"),
        ({"end_id": -2}, "end_id"),
        ({"stop_words": ("",)}, "stop_words"),
    ],
)
def test_invalid_sampling_option_names_the_field(fields: dict, named: str) -> None:
    with pytest.raises(InvalidOptionError, match=f"^{named}:"):
        SamplingOptions(**fields)


def test_sampling_inputs_leave_defaults_to_the_server() -> None:
    assert SamplingOptions(max_tokens=8).inputs() == {"max_tokens": 8}
    inputs = SamplingOptions(max_tokens=8, top_k=5, seed=7, stop_words=["a"], return_log_probs=True).inputs()
    assert inputs == {"max_tokens": 8, "top_k": 5, "seed": 7, "stop_words": ["a"], "return_log_probs": True}


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"url": "localhost"}, "url"),
        ({"url": "localhost:99999"}, "url"),
        ({"protocol": "ftp"}, "protocol"),
        ({"model": ""}, "model"),
        ({"max_concurrency": 0}, "max_concurrency"),
        ({"request_timeout_s": 0}, "request_timeout_s"),
    ],
)
def test_invalid_client_config_names_the_field(fields: dict, named: str) -> None:
    with pytest.raises(InvalidOptionError, match=f"^{named}:"):
        ClientConfig(**fields)


def test_config_defaults_and_url_forms() -> None:
    assert ClientConfig().url == "localhost:8001"
    assert ClientConfig(protocol="http").url == "localhost:8000"
    assert ClientConfig(url="http://10.0.0.1:8000/", protocol="http").url == "10.0.0.1:8000"
    with pytest.raises(InvalidOptionError, match="^rate:"):
        RateLimit(rate=0)
    with pytest.raises(InvalidOptionError, match="^burst:"):
        RateLimit(rate=1, burst=0.5)
    with pytest.raises(InvalidOptionError, match="^attempts:"):
        RetryPolicy(attempts=0)


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        ("server busy, retry later: waiting queue is full", ServerBusyError),
        ("Request for unknown model: 'x' is not found", ModelNotFoundError),
        ("failed to connect to all addresses", ServerUnavailableError),
        ("Stub process 'tensorrt_llm_bls_0_0' is not healthy.", ServerUnavailableError),
        (
            "in ensemble 'ensemble', input 'runtime_top_p' (ensemble/BLS: 'top_p'): must be in [0, 1]",
            InvalidRequestError,
        ),
        ("internal error: something broke", ServerError),
    ],
)
def test_error_classification(message: str, expected: type) -> None:
    assert type(classify(message, "ensemble")) is expected
