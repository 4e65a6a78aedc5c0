// The bilinear sampling of d2export's fused MSDA operator, shared by its CPU kernel (msda_op.cc) and its CUDA kernel
// (msda_op_cuda.cu): one point's four corners and their weights, and one channel's blend of them. Both kernels call
// exactly these functions, so they sample alike: pixel coordinates in double, align_corners=False, zero padding (a
// corner outside the level weighs 0 and reads a clamped, valid pixel instead, so that no corner needs a branch in the
// channel loop), a point whose whole footprint is outside the level (or NaN) contributes nothing.
#pragma once

#include <math.h>

#include <cstdint>

#if defined(__CUDACC__)
#define D2_HD __host__ __device__ __forceinline__
#else
#define D2_HD inline
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
  const double x = static_cast<double>(loc_x) * width - 0.5;
  const double y = static_cast<double>(loc_y) * height - 0.5;
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

// One channel's share of a point: the four corner values (a: top left, b: top right, c: bottom left, d: bottom right)
// blended in float, in the order both kernels accumulate.
D2_HD float blend(float a, float b, float c, float d, float w00, float w01, float w10, float w11) {
  return (w00 * a + w01 * b) + (w10 * c + w11 * d);
}

// The level tables as the CUDA kernel takes them (by value, as a kernel argument: no copy, no allocation).
constexpr int kMaxLevels = 16;
struct Levels {
  int64_t height[kMaxLevels], width[kMaxLevels], start[kMaxLevels];
};

// One output element as the CUDA kernel computes it: channel `head[0]` of head h of image row `row` (head points at
// that image's value, that head and channel; `row_head` = row * M + h), summed over every level and point in the CPU
// kernel's order. `load(pointer)` reads one value as float (float16 widened). Tested on the CPU through this very
// function (tests/test_msda_cuda_build.py).
template <typename T, typename Load>
D2_HD float element(const T* head, const float* loc, const float* attn, const Levels& levels, int n_levels,
                    int64_t points, int64_t row_head, int64_t width_md, Load load) {
  float acc = 0.0f;
  for (int lv = 0; lv < n_levels; ++lv) {
    const int64_t height = levels.height[lv], width = levels.width[lv];
    if (height == 0 || width == 0) continue;  // no pixels (a clamped read would leave the level)
    const T* level = head + levels.start[lv] * width_md;
    const int64_t first = (row_head * n_levels + lv) * points;  // loc and attn: [row, M, L, P]
    for (int64_t i = first; i < first + points; ++i) {
      Corners c;
      if (!corners(loc[2 * i], loc[2 * i + 1], attn[i], height, width, c)) continue;
      acc += blend(load(level + c.top_left * width_md), load(level + c.top_right * width_md),
                   load(level + c.bottom_left * width_md), load(level + c.bottom_right * width_md), c.w00, c.w01,
                   c.w10, c.w11);
    }
  }
  return acc;
}

}  // namespace msda
