"""Build an engine directory from a HF checkpoint: `build_engines/build.py` (CLI in `tritonllm.builder.cli`).

What was built is recorded in the engine-directory format of `tritonllm.engine_format` (which the
loader, the engine and the Triton models read without importing this package); the build itself is in
`builder`, the project's engine format in `torch_engine`, TensorRT-LLM in `trtllm_build`.
"""
