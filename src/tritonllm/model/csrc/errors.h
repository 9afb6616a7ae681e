// Messages for the kernels' TORCH_CHECKs, built without std::ostream. With PyTorch 2.11's CUDA wheel and the
// system's GCC 13 (the H200 machine, 2026-11-30), a failed check that streamed an integer into its message
// crashed the process (SIGSEGV in ostream::_M_insert<long> inside this extension) instead of raising; checks
// with literal messages raised. TORCH_CHECK passes a single std::string through without a stream.
#pragma once
#include <string>
#include <type_traits>

namespace errors {

inline std::string piece(const char* text) { return text; }

template <typename T, typename = std::enable_if_t<std::is_integral_v<T>>>
std::string piece(T value) {
  return std::to_string(value);
}

template <typename... Parts>
std::string message(const Parts&... parts) {
  return (std::string() + ... + piece(parts));
}

}  // namespace errors
