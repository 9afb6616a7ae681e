"""Triton model: see tritonllm.triton.models.BLSModel."""

from tritonllm.triton.models import BLSModel as TritonPythonModel

__all__ = ["TritonPythonModel"]
