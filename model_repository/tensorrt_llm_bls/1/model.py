"""Triton model: see tritonllm.triton.models.tensorrt_llm_bls.BLSModel."""

from tritonllm.triton.models import BLSModel as TritonPythonModel

__all__ = ["TritonPythonModel"]
