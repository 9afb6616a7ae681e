"""Triton model: see tritonllm.triton.models.preprocessing.PreprocessingModel."""

from tritonllm.triton.models import PreprocessingModel as TritonPythonModel

__all__ = ["TritonPythonModel"]
