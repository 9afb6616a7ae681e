"""The names of the weight quantizations and compute dtypes: one list each, for every layer.

The model loader, the engine's config, the builder, the launcher and the CLIs validate and offer these
names; keeping them here (importing nothing) lets the lowest layer, the model, use them too.
"""

# "auto": the engine picks the fastest accurate dtype for the device; the builder keeps the checkpoint's.
DTYPES = ("auto", "float32", "float16", "bfloat16")
# The engine's KV cache: "auto" (auto_kv_cache_dtype), a float dtype, or int8 rows with a scale each
# (model/kv_rows.py) under float32 or bfloat16 activations.
KV_CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16", "int8")
TORCH_QUANTIZATIONS = ("none", "int8", "int7", "int4", "int8_wo", "fp8")  # what the project's engine runs
# Weights in blocks of 32 times activations the kernel quantizes to int8 itself (csrc/int8_linear.cpp).
BLOCK_QUANTIZATIONS = ("int8", "int7", "int4")
# What the engine accepts: "auto" is an engine directory's own quantization, else the fastest accurate one.
ENGINE_QUANTIZATIONS = ("auto", *TORCH_QUANTIZATIONS)
TRTLLM_QUANTIZATIONS = ("none", "fp8", "int8_sq", "int8_wo", "int4_awq", "int4_wo")
QUANTIZATIONS = tuple(dict.fromkeys(TORCH_QUANTIZATIONS + TRTLLM_QUANTIZATIONS))  # what a build accepts
