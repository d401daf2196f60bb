// 16-float vectors for the native kernels, as GCC/Clang vector extensions: one AVX-512 register,
// two AVX2 ones (the compiler picks with -march=native). Loads take float32 or bfloat16 bits.
#pragma once

#include <cstdint>
#include <cstring>

namespace {

typedef float vf __attribute__((vector_size(64)));
typedef int32_t vi __attribute__((vector_size(64)));
typedef uint32_t vu __attribute__((vector_size(64)));
typedef uint16_t vh __attribute__((vector_size(32)));
constexpr int kLanes = 16;

// A float vector F loaded from float32, or from bfloat16 bits (uint16) widened to float32: the bits
// move to the high half. U and H: F's lanes as uint32 and uint16. For other kernels' vector widths too.
template <typename F>
inline F load_floats(const float* p) {
  F v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

template <typename F, typename U, typename H>
inline F load_floats(const uint16_t* p) {
  H h;
  std::memcpy(&h, p, sizeof h);
  U w = __builtin_convertvector(h, U) << 16;
  F v;
  std::memcpy(&v, &w, sizeof v);
  return v;
}

inline vf load16(const float* p) { return load_floats<vf>(p); }
inline vf load16(const uint16_t* p) { return load_floats<vf, vu, vh>(p); }

inline void store16(float* p, vf v) { std::memcpy(p, &v, sizeof v); }

}  // namespace
