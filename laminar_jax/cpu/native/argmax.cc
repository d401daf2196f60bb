// Each row's first index of its maximum, for XLA:CPU through the XLA FFI (laminar_jax/native builds
// this file on first use; native/ops.py calls it from the rollout engine's sampling).
//
// x f32[B, V] -> i32[B]: the first index holding the row's maximum; a NaN counts as the maximum (the
// first NaN wins), as rollout/sampling.py's first_argmax defines it. The result is an index, so it is
// the same bits whichever of the two computes it.
// Why a kernel: in a decode step XLA:CPU computes first_argmax as a max, then writes the broadcast
// maximum and an index array of the logits' full size and reduces that, memory traffic that grows
// with the vocabulary. This reads each row once.

#include <algorithm>
#include <cstdint>

#include "parallel.h"
#include "vec16.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int32_t kNone = INT32_MAX;

// Vectors of one register of this CPU (vec16.h's kW floats, va and vai): on AVX2, 16-float vectors
// take two registers each and run an order of magnitude slower than 8-float ones. Without AVX2's
// vector blend the selects go scalar, so the engine calls this only on CPUs with AVX2 or AVX-512
// (native/ops.py, first_argmax_is_faster).

// One pass, kW lanes: each lane keeps its largest value and the first index it was seen at
// (a later equal value does not replace it), and its first NaN. The row's answer is then the first
// NaN of any lane, else the smallest index among the lanes that hold the row's maximum.
int32_t row_argmax(const float* x, int64_t n) {
  const int64_t nv = n / kW * kW;
  int32_t best = kNone, nan_at = kNone;
  float top = 0.0f;
  if (nv > 0) {
    vai lane;
    for (int l = 0; l < kW; ++l) lane[l] = l;
    va m = loadv(x);
    vai at = lane, first_nan = vai{} + kNone;
    for (int64_t i = 0; i < nv; i += kW) {
      const va v = loadv(x + i);
      const vai cur = lane + int32_t(i);
      const vai gt = v > m;
      m = gt ? v : m;
      at = gt ? cur : at;
      const vai take = (v != v) & (first_nan == kNone);
      first_nan = take ? cur : first_nan;
    }
    top = m[0];
    for (int l = 1; l < kW; ++l) top = m[l] > top ? m[l] : top;
    for (int l = 0; l < kW; ++l) {
      nan_at = std::min(nan_at, first_nan[l]);
      if (m[l] == top) best = std::min(best, at[l]);  // NaN lanes never compare equal: handled above
    }
  }
  for (int64_t i = nv; i < n; ++i) {  // the tail: indices above every lane's
    if (x[i] != x[i]) {
      nan_at = std::min<int32_t>(nan_at, int32_t(i));
    } else if (best == kNone || x[i] > top) {
      top = x[i];
      best = int32_t(i);
    }
  }
  if (nan_at != kNone) return nan_at;
  return best == kNone ? 0 : best;  // all -inf lanes still hold their first index: kNone only if n == 0
}

ffi::Error first_argmax(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::S32> out) {
  auto d = x.dimensions();
  if (d.size() != 2) return ffi::Error::InvalidArgument("expected x[B, V]");
  const int64_t b = d[0], n = d[1];
  if (n >= kNone) return ffi::Error::InvalidArgument("rows of 2^31 or more elements");
  const float* xp = x.typed_data();
  int32_t* op = out->typed_data();
  for_units(pool, b, b * n >= kSpreadMin, [=](int64_t r) { op[r] = row_argmax(xp + r * n, n); });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(LaminarFirstArgmax, first_argmax,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());
