// The bilinear sampling of d2export's fused MSDA operator, shared by its CPU kernel (msda_op.cc) and its CUDA kernel
// (msda_op_cuda.cu): one point's four corners and their weights, and one channel's blend of them. Both kernels call
// exactly these functions, so they sample alike: pixel coordinates in double, align_corners=False, zero padding (a
// corner outside the level weighs 0 and reads a clamped, valid pixel instead, so that no corner needs a branch in the
// channel loop), a point whose whole footprint is outside the level (or NaN) contributes nothing. float16 inputs are
// widened exactly to float and every sum is a float; a float16 output is that float rounded once (to nearest even).
// Fused multiply-adds are written out (fma, fmaf: one rounding, the same on every CPU and GPU) and the compilers may
// contract nothing else (-ffp-contract=off, nvcc -fmad=false), so every build and every clone of the CPU kernel, and
// the CUDA kernel, round alike: the same bits (d2export/kernels/native_build.py).
#pragma once

#include <math.h>
#include <string.h>

#include <cstdint>

#if defined(__CUDACC__)
#define D2_HD __host__ __device__ __forceinline__
#else
#define D2_HD inline
#endif
#if defined(__CUDA_ARCH__)  // the device pass only: host compilers warn about a pragma they do not know
#define D2_UNROLL _Pragma("unroll")
#else
#define D2_UNROLL
#endif

namespace msda {

// One sampling point on one level: the four corners' token offsets within the level (row-major, y * width + x) and
// their weights, attention weight included.
struct Corners {
  int64_t top_left, top_right, bottom_left, bottom_right;
  float w00, w01, w10, w11;  // (top, left), (top, right), (bottom, left), (bottom, right)
};

D2_HD int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }
D2_HD int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

// The corners of location (loc_x, loc_y) in [0, 1] (as the graph hands it) on a `height` x `width` level with
// attention weight `attn`; false where the point contributes nothing. The level must have pixels (height, width > 0).
D2_HD bool corners(float loc_x, float loc_y, float attn, int64_t height, int64_t width, Corners& c) {
  const double x = fma(static_cast<double>(loc_x), static_cast<double>(width), -0.5);
  const double y = fma(static_cast<double>(loc_y), static_cast<double>(height), -0.5);
  if (!(x > -1.0 && y > -1.0 && x < width && y < height)) return false;  // every corner in the padding, or NaN
  const double a = attn;
  const double fx0 = floor(x), fy0 = floor(y);
  const int64_t x0 = static_cast<int64_t>(fx0), y0 = static_cast<int64_t>(fy0);
  double wx1 = x - fx0, wy1 = y - fy0, wx0 = 1.0 - wx1, wy0 = 1.0 - wy1;
  if (x0 < 0) wx0 = 0.0;
  if (x0 + 1 >= width) wx1 = 0.0;
  if (y0 < 0) wy0 = 0.0;
  if (y0 + 1 >= height) wy1 = 0.0;
  wy0 *= a;
  wy1 *= a;
  const int64_t left = max64(x0, 0), right = min64(x0 + 1, width - 1);
  const int64_t top = max64(y0, 0) * width, bottom = min64(y0 + 1, height - 1) * width;
  c.top_left = top + left;
  c.top_right = top + right;
  c.bottom_left = bottom + left;
  c.bottom_right = bottom + right;
  c.w00 = static_cast<float>(wy0 * wx0);
  c.w01 = static_cast<float>(wy0 * wx1);
  c.w10 = static_cast<float>(wy1 * wx0);
  c.w11 = static_cast<float>(wy1 * wx1);
  return true;
}

// One channel's sum `acc` with a point's four corner values added (a: top left, b: top right, c: bottom left, d:
// bottom right), each weighted, in one chain of multiply-adds: the order both kernels accumulate in. (Measured on the
// CPU: 4-7% faster than two products summed in pairs, which carried a dependency on two adds per point.)
D2_HD float blend(float acc, float a, float b, float c, float d, float w00, float w01, float w10, float w11) {
  return fmaf(w11, d, fmaf(w10, c, fmaf(w01, b, fmaf(w00, a, acc))));
}

// IEEE binary16 <-> float on the host, as bits (uint16_t), portable to any compiler and CPU: the CPU kernel's float16
// (the CUDA kernel uses the device's own conversions, which round alike). Widening is exact; narrowing rounds to
// nearest, ties to even, overflowing to infinity from 65520 on, NaN staying NaN.
inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
  uint32_t bits;
  if (exponent == 0x1f) {
    bits = sign | 0x7f800000u | (mantissa << 13);  // infinity, or NaN with its payload
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);  // rebias 15 -> 127
  } else {
    const float f = static_cast<float>(mantissa) * 5.9604644775390625e-8f;  // subnormal: mantissa * 2^-24, exact
    return sign ? -f : f;
  }
  float f;
  memcpy(&f, &bits, sizeof f);
  return f;
}

inline uint16_t float_to_half(float f) {
  uint32_t bits;
  memcpy(&bits, &f, sizeof bits);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t magnitude = bits & 0x7fffffffu;
  if (magnitude > 0x7f800000u) return sign | 0x7e00u | ((magnitude >> 13) & 0x3ffu);  // NaN, kept quiet
  if (magnitude >= 0x477ff000u) return sign | 0x7c00u;  // 65520 and up (infinity included): infinity
  uint32_t q, rest, half;
  if (magnitude < 0x38800000u) {  // below 2^-14: a subnormal half (or zero), in units of 2^-24
    const uint32_t exponent = magnitude >> 23;
    if (exponent < 102) return sign;  // below 2^-25, which (even 0 as the tie) rounds to zero
    const uint32_t shift = 126 - exponent;  // 14..24
    const uint32_t mantissa = (magnitude & 0x7fffffu) | 0x800000u;
    q = mantissa >> shift;
    rest = mantissa & ((1u << shift) - 1);
    half = 1u << (shift - 1);
  } else {
    q = (magnitude - 0x38000000u) >> 13;  // rebias 127 -> 15 and drop 13 mantissa bits
    rest = magnitude & 0x1fffu;
    half = 0x1000u;
  }
  if (rest > half || (rest == half && (q & 1u))) ++q;  // a carry into the exponent is the right encoding
  return static_cast<uint16_t>(sign | q);
}

// The level tables as the CUDA kernel takes them (by value, as a kernel argument: no copy, no allocation).
constexpr int kMaxLevels = 16;
struct Levels {
  int64_t height[kMaxLevels], width[kMaxLevels], start[kMaxLevels];
};

// What one CUDA thread computes: V consecutive channels of head h of image row `row`, added into acc (zeroed by the
// caller), summed over every level and point in the CPU kernel's order (per channel the same terms, the same
// roundings). `head` points at that image's value, that head and its first channel; `row_head` = row * M + h.
// Each point's location, weight and corners are read and computed once for all V channels; `load(pointer, values)`
// reads V channels of one corner as floats (wide loads on the GPU), `widen(x)` reads a location or weight as float.
// Tested on the CPU through this very function (tests/test_msda_cuda_build.py).
template <int V, typename T, typename U, typename Load, typename Widen>
D2_HD void accumulate(const T* head, const U* loc, const U* attn, const Levels& levels, int n_levels, int64_t points,
                      int64_t row_head, int64_t width_md, Load load, Widen widen, float (&acc)[V]) {
  for (int lv = 0; lv < n_levels; ++lv) {
    const int64_t height = levels.height[lv], width = levels.width[lv];
    if (height == 0 || width == 0) continue;  // no pixels (a clamped read would leave the level)
    const T* level = head + levels.start[lv] * width_md;
    const int64_t first = (row_head * n_levels + lv) * points;  // loc and attn: [row, M, L, P]
    for (int64_t i = first; i < first + points; ++i) {
      Corners c;
      if (!corners(widen(loc[2 * i]), widen(loc[2 * i + 1]), widen(attn[i]), height, width, c)) continue;
      float a[V], b[V], d[V], e[V];
      load(level + c.top_left * width_md, a);
      load(level + c.top_right * width_md, b);
      load(level + c.bottom_left * width_md, d);
      load(level + c.bottom_right * width_md, e);
      D2_UNROLL
      for (int k = 0; k < V; ++k) acc[k] = blend(acc[k], a[k], b[k], d[k], e[k], c.w00, c.w01, c.w10, c.w11);
    }
  }
}

}  // namespace msda
