"""The Triton Python models, one module each, named as the model; `common` holds what they share.

`model_repository/*/1/model.py` imports its class from here. The request logic lives beside this package
in `tritonllm.triton` (`tensors`, `text`, `bridge`, `metrics`).
"""

from tritonllm.triton.models.postprocessing import PostprocessingModel
from tritonllm.triton.models.preprocessing import PreprocessingModel
from tritonllm.triton.models.tensorrt_llm import EngineModel
from tritonllm.triton.models.tensorrt_llm_bls import BLSModel

__all__ = ["BLSModel", "EngineModel", "PostprocessingModel", "PreprocessingModel"]
