"""tritonllm: LLM serving on Triton Inference Server."""
