"""Triton model: see tritonllm.triton.models.postprocessing.PostprocessingModel."""

from tritonllm.triton.models import PostprocessingModel as TritonPythonModel

__all__ = ["TritonPythonModel"]
