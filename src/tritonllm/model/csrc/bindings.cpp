// One extension module for the CPU kernels. Each call releases the GIL: the engine loop runs beside
// threads that send responses, and a step's kernels should not stall them.
// The kernels are included as one translation unit, so that PyTorch's headers are parsed once (three units took
// three times as long). Each file includes only the ATen headers it uses, not torch/extension.h: that header
// alone took 22 s to parse, and a whole build 45 s instead of 24 (Zen 4, one variant).
#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>
#include <pybind11/stl.h>

#include "layer_ops.cpp"
#include "linear.cpp"
#include "int8_linear.cpp"
#include "int7_linear.cpp"
#include "int4_linear.cpp"
#include "bf16_packed_linear.cpp"
#include "paged_attention.cpp"
#include "prefill_attention.cpp"
#include "decode_stack.cpp"
#include "sampling.cpp"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using release = pybind11::call_guard<pybind11::gil_scoped_release>;
  m.def("use_thread_pool", &thread_pool::use,
        "the calling thread's kernels on n threads of the kernels' own pool and its PyTorch ops on itself (0: OpenMP)",
        pybind11::arg("n"));
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention over a paged KV cache", release());
  m.def("paged_prefill_attention", &paged_prefill_attention,
        "causal attention of a step's prefill chunks (variable lengths) over a paged KV cache", release());
  m.def("int8_pack", &int8_pack, "int8 weights in blocks of 32 + their scales, in the kernels' tiles (8 rows, 16 in the VNNI builds)",
        pybind11::arg("weight"), pybind11::arg("scales"), release());
  m.def("int8_linear", &int8_linear, "x @ W^T for packed int8 weights (activations quantized per block of 32)",
        pybind11::arg("x"), pybind11::arg("packed"), pybind11::arg("bias") = pybind11::none(), release());
  m.def("widened_min_tokens", &widened_min_tokens,
        "from how many tokens int8/int4 linears run bf16 activations x weights widened to bf16 (amx build; 0: never)");
  m.def("int7_pack", &int7_pack, "7-bit weights (-63..63) in int8's blocks + their scales, in int8's tiles (an int8 tensor)",
        pybind11::arg("weight"), pybind11::arg("scales"), release());
  m.def("int7_linear", &int7_linear, "x @ W^T for packed int7 weights (activations quantized per block of 32)",
        pybind11::arg("x"), pybind11::arg("packed"), pybind11::arg("bias") = pybind11::none(), release());
  m.def("int7_runs_as_int8", &int7_runs_as_int8, "whether this build packs and runs int7 weights as int8 (VNNI, AMX)");
  m.def("int4_pack", &int4_pack, "4-bit weights in blocks of 32 (q4_0's nibbles) + their scales, in the kernels' tiles",
        pybind11::arg("weight"), pybind11::arg("scales"), release());
  m.def("int4_linear", &int4_linear, "x @ W^T for packed int4 weights (activations quantized per block of 32)",
        pybind11::arg("x"), pybind11::arg("packed"), pybind11::arg("bias") = pybind11::none(), release());
  m.def("bf16_linear", &bf16_linear, "x @ W^T for bfloat16 weights, fp32 accumulation", pybind11::arg("x"),
        pybind11::arg("weight"), pybind11::arg("bias") = pybind11::none(), release());
  m.def("bf16_pack", &bf16_pack, "bfloat16 weights in tiles of 16 rows x pairs of inputs, for bf16_packed_linear",
        pybind11::arg("weight"), release());
  m.def("bf16_packed_linear", &bf16_packed_linear, "x @ W^T for packed bfloat16 weights (vdpbf16ps, fp32 sums)",
        pybind11::arg("x"), pybind11::arg("packed"), pybind11::arg("bias") = pybind11::none(), release());
  m.def("packs_bf16", &packs_bf16, "whether bf16 weights run packed (bf16_pack) in this build, at this GEMM threshold");
  m.def("set_onednn_bf16_min_tokens", &set_onednn_bf16_min_tokens,
        "from how many tokens bf16 activations x bf16 weights run through ATen's GEMM (oneDNN, AMX); 0: never");
  m.def("onednn_bf16_min_tokens", &onednn_bf16_min_tokens, "see set_onednn_bf16_min_tokens");
  m.def("add_rms_norm", &add_rms_norm, "x += delta (in place, when given); returns rms_norm(x) * weight",
        pybind11::arg("x"), pybind11::arg("delta"), pybind11::arg("weight"), pybind11::arg("eps"), release());
  m.def("rope_and_cache", &rope_and_cache, "RoPE on q and k of a fused qkv; k and v written to the paged cache",
        release());
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up of a fused [T, 2F] projection", release());
  m.def("decode_layers", &decode_layers, "all decoder layers of a decode-only step (the layer loop in C++)",
        release());
  m.def("greedy_tokens", &greedy_tokens, "each row's argmax, as torch.argmax(logits, -1) picks it", release());
  m.def("built_with_avx2", &built_with_avx2, "whether this build uses the AVX2 code paths");
}
