"""`engine_link`: the BLS's gRPC requests to `tensorrt_llm` (served end to end in test_models and others)."""

from __future__ import annotations

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from triton_fixture import free_ports
from tritonclient.grpc import service_pb2
from tritonclient.grpc._utils import _get_inference_request

from tritonllm.triton.models.engine_link import (
    UNREACHABLE,
    EngineCallError,
    EngineLink,
    EngineStream,
    infer_request,
    response_outputs,
)


@pytest.mark.parametrize("timeout_us", [0, 2_500_000])
def test_infer_request_is_what_tritonclient_sends(timeout_us: int) -> None:
    """Every input type the BLS passes on (ids, lengths, flags, floats, seeds, guide strings), and the
    request timeout as tritonclient's `timeout=` sends it (0: none)."""
    inputs = {
        "input_ids": np.array([[1, 2, 3]], dtype=np.int32),
        "streaming": np.array([[True]], dtype=bool),
        "temperature": np.array([[0.5]], dtype=np.float32),
        "random_seed": np.array([[7]], dtype=np.uint64),
        "guided_decoding_guide": np.array([[b'{"type": "object"}']], dtype=object),
        "stop_words_list": np.zeros((1, 2, 0), dtype=np.int32),
    }
    theirs = []
    for name, array in inputs.items():
        tensor = grpcclient.InferInput(name, list(array.shape), grpcclient.np_to_triton_dtype(array.dtype))
        theirs.append(tensor.set_data_from_numpy(array))
    outputs = [grpcclient.InferRequestedOutput(n) for n in ("output_ids", "sequence_length")]
    expected = _get_inference_request(
        "tensorrt_llm", theirs, "", "bls-1", outputs, 0, False, False, 0, timeout_us or None, None
    )  # fmt: skip
    ours = infer_request("tensorrt_llm", "bls-1", inputs, ["output_ids", "sequence_length"], timeout_us)
    assert ours == expected


def test_an_unreachable_engine_is_a_clear_error() -> None:
    (port,) = free_ports(1)  # nothing listens there
    link = EngineLink(f"127.0.0.1:{port}", "tensorrt_llm")
    try:
        stream = link.open("bls-1", {"input_ids": np.array([[1]], dtype=np.int32)}, ["output_ids"])
        expected = rf"^{UNREACHABLE} over gRPC at 127.0.0.1:{port} \(UNAVAILABLE"
        with pytest.raises(EngineCallError, match=expected):
            list(stream)
    finally:
        link.close()


def test_an_error_response_is_raised_after_the_stream_ends() -> None:
    """An error is a request's final response; the stream is read to its end before raising, because leaving
    the call there cancels it under Triton 2.51 while it finishes the stream, and the server's handler then
    holds the engine model (an unload hung until its deadline)."""
    error = service_pb2.ModelStreamInferResponse(error_message="server busy: 1 request waiting")
    flag_only = service_pb2.ModelStreamInferResponse()  # what could follow: ignored once failed
    read = []

    def call():
        for message in (error, flag_only):
            read.append(message)
            yield message
        read.append("end")

    with pytest.raises(EngineCallError, match="server busy"):
        list(EngineStream(call(), "127.0.0.1:1"))
    assert read == [error, flag_only, "end"], "read to the end first"


def test_response_outputs_read_as_tritonclient_reads_them() -> None:
    """Each type `tensorrt_llm` sends: ids, counts, log-probabilities, timings, finish reasons."""
    arrays = {
        "output_ids": np.array([[[5, 6, 7]]], dtype=np.int32),
        "num_output_tokens": np.array([[3]], dtype=np.uint32),
        "cum_log_probs": np.array([[-0.5]], dtype=np.float32),
        "arrival_time_ns": np.array([[123456789012]], dtype=np.int64),
        "finish_reason": np.array([[b"length"]], dtype=object),
        "empty": np.zeros((1, 0), dtype=np.float32),
    }
    response = service_pb2.ModelInferResponse(model_name="tensorrt_llm")
    for name, array in arrays.items():
        tensor = grpcclient.InferInput(name, list(array.shape), grpcclient.np_to_triton_dtype(array.dtype))
        tensor.set_data_from_numpy(array)
        response.outputs.append(
            service_pb2.ModelInferResponse.InferOutputTensor(
                name=name, datatype=tensor.datatype(), shape=array.shape
            )
        )
        response.raw_output_contents.append(tensor._raw_content or b"")
    ours = response_outputs(response)
    theirs = grpcclient.InferResult(response)
    for name, array in arrays.items():
        assert ours[name].dtype == theirs.as_numpy(name).dtype and ours[name].shape == array.shape, name
        np.testing.assert_array_equal(ours[name], theirs.as_numpy(name))
        np.testing.assert_array_equal(ours[name], array)
