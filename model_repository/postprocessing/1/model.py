"""Triton model: see tritonllm.triton.models.PostprocessingModel."""

from tritonllm.triton.models import PostprocessingModel as TritonPythonModel

__all__ = ["TritonPythonModel"]
