"""Triton model: see tritonllm.triton.models.EngineModel."""

from tritonllm.triton.models import EngineModel as TritonPythonModel

__all__ = ["TritonPythonModel"]
