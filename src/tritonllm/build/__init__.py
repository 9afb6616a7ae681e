"""Build an engine directory from a HF checkpoint: `build_engines/build.py` (CLI in `tritonllm.build.cli`).

`engine_dir` (what was built, read by the loader and the Triton model) imports nothing heavy; the
build itself is in `builder`, the project's engine format in `torch_engine`, TensorRT-LLM in `trtllm_*`.
"""
