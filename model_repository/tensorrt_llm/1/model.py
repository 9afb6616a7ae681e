"""Triton model: see tritonllm.triton.models.tensorrt_llm.EngineModel."""

from tritonllm.triton.models import EngineModel as TritonPythonModel

__all__ = ["TritonPythonModel"]
