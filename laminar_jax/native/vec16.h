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

inline vf load16(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// 16 bfloat16 values (their uint16 bits) widened to float32: the bits move to the high half.
inline vf load16(const uint16_t* p) {
  vh h;
  std::memcpy(&h, p, sizeof h);
  vu w = __builtin_convertvector(h, vu) << 16;
  vf v;
  std::memcpy(&v, &w, sizeof v);
  return v;
}

inline void store16(float* p, vf v) { std::memcpy(p, &v, sizeof v); }

}  // namespace
