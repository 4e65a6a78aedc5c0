// The CPU kernel's rows, shared by d2export's fused MSDA operator for onnxruntime (msda_op.cc) and for OpenVINO
// (msda_openvino.cc): one output row (image, query) over every head, level and point, with msda_sample.h's sampling.
// Each library includes this once, so both compute the same bits (native_build.py: no multiply-add contraction).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "msda_sample.h"

namespace msda_rows {

// float16 is carried as its bits (uint16_t) on the host: widened exactly, accumulated in float, rounded once.
using Half = uint16_t;
inline float widen(float x) { return x; }
inline float widen(Half x) { return msda::half_to_float(x); }
inline void narrow(float x, float& out) { out = x; }
inline void narrow(float x, Half& out) { out = msda::float_to_half(x); }

// T: value and output (float or Half); U: locations and weights.
template <typename T, typename U>
struct Problem {
  const T* value;          // [N * S, M * D]
  const int64_t* shapes;   // [L, 2]
  const int64_t* starts;   // [L]
  const U* loc;            // [N * Lq * M * L * P * 2]
  const U* attn;           // [N * Lq * M * L * P]
  T* out;                  // [N * Lq, M * D]
  int64_t tokens, heads, dim, queries, levels, points;
};

// acc += w00 * a + w01 * b + w10 * c + w11 * d over n channels (msda::blend's chain of multiply-adds). The restrict
// pointers let the compiler vectorise along D without run-time overlap checks (the accumulator never aliases value).
template <typename T>
inline void blend4(float* __restrict acc, const T* __restrict a, const T* __restrict b, const T* __restrict c,
                   const T* __restrict d, float w00, float w01, float w10, float w11, int64_t n) {
  for (int64_t k = 0; k < n; ++k) {
    acc[k] = msda::blend(acc[k], widen(a[k]), widen(b[k]), widen(c[k]), widen(d[k]), w00, w01, w10, w11);
  }
}

// Built for the default x86-64 target (the library may move between CPUs), the D loop would get 4-float SSE vectors
// only; GCC and clang clone the row's code for AVX-512 and for x86-64-v3 (AVX2 with FMA, which the sampling's fmaf
// needs to be one instruction) and pick one when the library loads. Every clone computes the same bits: the header's
// multiply-adds are explicit and nothing else is contracted (d2export/kernels/native_build.py). D2_NO_CLONES: one
// build for the -march given, as the tests build each clone's level.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__APPLE__) && !defined(D2_NO_CLONES)
#define D2_CLONES __attribute__((target_clones("avx512f", "arch=x86-64-v3", "default")))
#else
#define D2_CLONES
#endif

// One output row: image row / Lq, query row % Lq, every head, level and point, accumulated in float into `acc` (the
// float32 output row itself; for a float16 output, a float row rounded once at the end).
template <typename T, typename U>
inline void compute_row(const Problem<T, U>& p, int64_t row, float* acc) {
  const int64_t width_md = p.heads * p.dim;  // values per token in value and per row in out
  std::fill(acc, acc + width_md, 0.0f);
  const T* image = p.value + (row / p.queries) * p.tokens * width_md;
  for (int64_t h = 0; h < p.heads; ++h) {
    float* acc_h = acc + h * p.dim;
    const T* head = image + h * p.dim;
    for (int64_t lv = 0; lv < p.levels; ++lv) {
      const int64_t height = p.shapes[2 * lv], width = p.shapes[2 * lv + 1];
      if (height == 0 || width == 0) continue;  // no pixels (a clamped read would leave the level)
      const T* level = head + p.starts[lv] * width_md;
      const int64_t first = ((row * p.heads + h) * p.levels + lv) * p.points;  // loc and attn: [row, M, L, P]
      for (int64_t i = first; i < first + p.points; ++i) {
        msda::Corners c;
        const float x = widen(p.loc[2 * i]), y = widen(p.loc[2 * i + 1]), a = widen(p.attn[i]);
        if (!msda::corners(x, y, a, height, width, c)) continue;
        blend4(acc_h, level + c.top_left * width_md, level + c.top_right * width_md, level + c.bottom_left * width_md,
               level + c.bottom_right * width_md, c.w00, c.w01, c.w10, c.w11, p.dim);
      }
    }
  }
}

D2_CLONES void float_row(const Problem<float, float>& p, int64_t row) {
  compute_row(p, row, p.out + row * p.heads * p.dim);
}

// float16 rows: summed in `scratch`, one row per pool thread at a time (no allocation after a thread's first row).
template <typename U>
inline void half_row(const Problem<Half, U>& p, int64_t row) {
  const int64_t width_md = p.heads * p.dim;
  thread_local std::vector<float> scratch;
  if (scratch.size() < static_cast<size_t>(width_md)) scratch.resize(width_md);
  compute_row(p, row, scratch.data());
  Half* out = p.out + row * width_md;
  for (int64_t k = 0; k < width_md; ++k) narrow(scratch[k], out[k]);
}
// GCC refuses target_clones on templates: one plain function per variant.
D2_CLONES void half_row_float(const Problem<Half, float>& p, int64_t row) { half_row(p, row); }
D2_CLONES void half_row_half(const Problem<Half, Half>& p, int64_t row) { half_row(p, row); }

template <typename T, typename U>
void row_task(void* data, size_t index) {
  const auto& p = *static_cast<const Problem<T, U>*>(data);
  const auto row = static_cast<int64_t>(index);
  if constexpr (std::is_same_v<T, float>) {
    float_row(p, row);
  } else if constexpr (std::is_same_v<U, float>) {
    half_row_float(p, row);
  } else {
    half_row_half(p, row);
  }
}

// As Python prints a shape tuple, so that messages read as msda_kernel.msda's do.
inline std::string shape_str(const std::vector<int64_t>& dims) {
  std::string s = "(";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + (dims.size() == 1 ? ",)" : ")");
}

// Shapes checked as msda_kernel.msda checks them: what is wrong, or "" (each runtime reports it its own way). The
// level tables (their contents) are read only once their shapes are known to match.
inline std::string problem_with(const std::vector<int64_t>& value, const std::vector<int64_t>& shapes,
                                const std::vector<int64_t>& starts, const std::vector<int64_t>& loc,
                                const std::vector<int64_t>& attn, const int64_t* shape_data,
                                const int64_t* start_data) {
  if (value.size() != 4) return "MSDA: value " + shape_str(value) + " is not [N, S, M, D]";
  const bool attn_matches = attn.size() == 5 && loc.size() == 6 && std::equal(attn.begin(), attn.end(), loc.begin());
  if (loc.size() != 6 || loc[5] != 2 || loc[0] != value[0] || loc[2] != value[2] || !attn_matches) {
    return "MSDA: sampling_locations " + shape_str(loc) + " / attention_weights " + shape_str(attn) +
           " do not match value " + shape_str(value) + " ([N, Lq, M, L, P, 2] / [N, Lq, M, L, P] expected)";
  }
  const int64_t levels = loc[3];
  if (shapes != std::vector<int64_t>{levels, 2} || starts != std::vector<int64_t>{levels}) {
    return "MSDA: spatial_shapes " + shape_str(shapes) + " / level_start_index " + shape_str(starts) +
           " do not match " + std::to_string(levels) + " levels";
  }
  const int64_t tokens = value[1];
  for (int64_t lv = 0; lv < levels; ++lv) {
    const int64_t h = shape_data[2 * lv], w = shape_data[2 * lv + 1], start = start_data[lv];
    // h * w <= tokens - start, asked by division so that no product of huge sizes can overflow
    if (h < 0 || w < 0 || start < 0 || start > tokens || (h > 0 && w > (tokens - start) / h)) {
      std::string levels_str = "[", starts_str = "[";
      for (int64_t k = 0; k < levels; ++k) {
        levels_str += (k ? ", [" : "[") + std::to_string(shape_data[2 * k]) + ", " +
                      std::to_string(shape_data[2 * k + 1]) + "]";
        starts_str += (k ? ", " : "") + std::to_string(start_data[k]);
      }
      if (h < 0 || w < 0 || start < 0) {
        return "MSDA: spatial_shapes " + levels_str + "] / level_start_index " + starts_str +
               "] hold a negative size or start";
      }
      return "MSDA: the levels " + levels_str + "] need more tokens than value has (" + std::to_string(tokens) +
             ") from level_start_index " + starts_str + "]";
    }
  }
  return "";
}

}  // namespace msda_rows
