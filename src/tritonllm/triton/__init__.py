"""Triton Inference Server integration: the model repository's logic and the launcher.

Each Triton model in `model_repository/` is a thin `model.py` over a class in `tritonllm.triton.models`
(one module per model); request parsing (`tensors`), text handling (`text`), the engine bridge
(`bridge`) and metrics (`metrics`) are plain Python, unit-testable without a server.
"""
