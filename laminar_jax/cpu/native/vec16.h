// 16-float vectors for the native kernels, as GCC/Clang vector extensions: one AVX-512 register,
// two AVX2 ones (the compiler picks with -march=native). Loads take float32 or bfloat16 bits. Below
// them, vectors of one register of this CPU (kW floats).
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

// One register of the CPU a kernel is built for: 16 floats with AVX-512 (and elsewhere), 8 on AVX2
// without AVX-512, where a 16-float vector is two registers and loops that keep several of them
// spill to memory, an order of magnitude slower (paged attention, the argmax).
#if defined(__AVX2__) && !defined(__AVX512F__)
constexpr int kW = 8;
#else
constexpr int kW = 16;
#endif
typedef float va __attribute__((vector_size(kW * 4)));
typedef int32_t vai __attribute__((vector_size(kW * 4)));
typedef uint32_t vau __attribute__((vector_size(kW * 4)));
typedef uint16_t vah __attribute__((vector_size(kW * 2)));

inline va loadv(const float* p) { return load_floats<va>(p); }
inline va loadv(const uint16_t* p) { return load_floats<va, vau, vah>(p); }  // bfloat16 bits

inline void storev(float* p, va v) { std::memcpy(p, &v, sizeof v); }

}  // namespace
