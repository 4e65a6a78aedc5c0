// d2export's fused MSDA operator (d2export.MultiScaleDeformableAttention) for onnxruntime's CUDA execution provider.
//
// Built by setup.py into d2export/kernels/_msda_cuda*.so together with msda_op.cc (the CPU kernel, whose
// RegisterCustomOps adds these ops to the same domain) where nvcc exists, with cudart linked statically. Nothing here
// runs at load or registration: the ops are plain structs, so the library loads into a CPU-only onnxruntime on a
// machine without a GPU or a driver, and only a CUDA session's Compute calls into CUDA.
//
// It samples exactly as the CPU kernel (msda_sample.h's msda::accumulate: the same functions, coordinates in double,
// each output channel accumulated in float in the same order; built with -fmad=false, so no multiply-add is
// contracted that the CPU kernel computes in two roundings). Each thread computes kVector consecutive channels of one
// (image, query, head): a point's location, weight and corners are computed once for all of them, and each corner's
// channels come in 16-byte loads (8 float16, or 2 x 4 float32). Channels are the fastest index, so the threads of a
// head read a corner's D values, and write their outputs, contiguously. Where D is not a multiple of kVector or a
// pointer is not 16-byte aligned, the same kernel runs one channel per thread with scalar loads.
//
// The variants of msda_op.h: value and output float32 or float16, locations and weights float32 or float16 (read as
// such and widened; sums in float, a float16 output rounded once). spatial_shapes and level_start_index are CPU
// inputs (OrtMemTypeCPUInput): the shape checks read them on the host and they reach the kernel as its arguments, so
// Compute makes no copy, no allocation and no synchronisation; it launches on the provider's compute stream.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <exception>
#include <new>
#include <string>

#include "msda_op.h"
#include "msda_sample.h"
#include "ort_abi.h"

namespace {

constexpr int kThreads = 256;
constexpr int kVector = 8;  // channels per thread on the wide path: 16 bytes of float16, 32 of float32
using msda::kMaxLevels;
using msda::Levels;

// Reads V channels of one corner as floats. V = kVector only where the caller checked the address 16-byte aligned.
template <int V>
struct Load {
  __device__ __forceinline__ void operator()(const float* p, float (&v)[V]) const {
    if constexpr (V == kVector) {
      const float4 lo = __ldg(reinterpret_cast<const float4*>(p)), hi = __ldg(reinterpret_cast<const float4*>(p) + 1);
      v[0] = lo.x, v[1] = lo.y, v[2] = lo.z, v[3] = lo.w, v[4] = hi.x, v[5] = hi.y, v[6] = hi.z, v[7] = hi.w;
    } else {
#pragma unroll
      for (int k = 0; k < V; ++k) v[k] = __ldg(p + k);
    }
  }
  __device__ __forceinline__ void operator()(const __half* p, float (&v)[V]) const {
    if constexpr (V == kVector) {
      const uint4 raw = __ldg(reinterpret_cast<const uint4*>(p));
      const __half2* pairs = reinterpret_cast<const __half2*>(&raw);
#pragma unroll
      for (int k = 0; k < V / 2; ++k) {
        const float2 f = __half22float2(pairs[k]);
        v[2 * k] = f.x, v[2 * k + 1] = f.y;
      }
    } else {
#pragma unroll
      for (int k = 0; k < V; ++k) v[k] = __half2float(__ldg(p + k));
    }
  }
};
static_assert(kVector == 8, "Load and store move kVector channels as two float4 / one uint4 of halves");

struct Widen {
  __device__ __forceinline__ float operator()(float x) const { return x; }
  __device__ __forceinline__ float operator()(__half x) const { return __half2float(x); }
};

template <int V>
__device__ __forceinline__ void store(float* p, const float (&v)[V]) {
  if constexpr (V == kVector) {
    reinterpret_cast<float4*>(p)[0] = make_float4(v[0], v[1], v[2], v[3]);
    reinterpret_cast<float4*>(p)[1] = make_float4(v[4], v[5], v[6], v[7]);
  } else {
#pragma unroll
    for (int k = 0; k < V; ++k) p[k] = v[k];
  }
}
template <int V>
__device__ __forceinline__ void store(__half* p, const float (&v)[V]) {
  if constexpr (V == kVector) {
    uint4 raw;
    __half2* pairs = reinterpret_cast<__half2*>(&raw);
#pragma unroll
    for (int k = 0; k < V / 2; ++k) pairs[k] = __floats2half2_rn(v[2 * k], v[2 * k + 1]);  // each rounded to nearest
    *reinterpret_cast<uint4*>(p) = raw;
  } else {
#pragma unroll
    for (int k = 0; k < V; ++k) p[k] = __float2half_rn(v[k]);
  }
}

// T: value and output; U: locations and weights; V: channels per thread (kVector or 1). `total` = N * Lq * M * D / V
// threads' worth of work, in a grid-stride loop.
template <typename T, typename U, int V>
__global__ void __launch_bounds__(kThreads)
    msda_forward(const T* __restrict__ value, const U* __restrict__ loc, const U* __restrict__ attn,
                 T* __restrict__ out, const Levels levels, int64_t total, int64_t tokens, int64_t heads, int64_t dim,
                 int64_t queries, int n_levels, int64_t points) {
  const int64_t width_md = heads * dim;  // values per token, outputs per (image, query)
  const int64_t groups = dim / V;        // threads per (image, query, head)
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t channel = (idx % groups) * V;
    const int64_t row_head = idx / groups;  // (image * Lq + query) * M + head
    const int64_t h = row_head % heads;
    const int64_t row = row_head / heads;
    const T* head = value + (row / queries) * tokens * width_md + h * dim + channel;
    float acc[V];
#pragma unroll
    for (int k = 0; k < V; ++k) acc[k] = 0.0f;
    msda::accumulate<V>(head, loc, attn, levels, n_levels, points, row_head, width_md, Load<V>{}, Widen{}, acc);
    store<V>(out + row_head * dim + channel, acc);
  }
}

OrtStatus* fail(const OrtApi* api, OrtErrorCode code, const std::string& message) {
  return ort::get<ort::CreateStatusFn>(api, ort::CreateStatus)(code, message.c_str());
}

struct Kernel {
  const OrtApi* api;
};

template <typename T, typename U, int V>
void launch(const msda::Tensors& t, const Levels& levels, cudaStream_t stream) {
  const int64_t total = t.batch * t.queries * t.heads * (t.dim / V);
  const int64_t blocks_needed = (total + kThreads - 1) / kThreads;
  const unsigned blocks = static_cast<unsigned>(blocks_needed < (1LL << 30) ? blocks_needed : (1LL << 30));
  msda_forward<T, U, V><<<blocks, kThreads, 0, stream>>>(
      static_cast<const T*>(t.value), static_cast<const U*>(t.loc), static_cast<const U*>(t.attn),
      static_cast<T*>(t.out), levels, total, t.tokens, t.heads, t.dim, t.queries, static_cast<int>(t.levels),
      t.points);
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

template <typename T, typename U>
OrtStatus* compute(const OrtApi* api, OrtKernelContext* context) {
  msda::Tensors t;
  if (OrtStatus* status = msda::prepare(api, context, t)) return status;
  if (t.levels > kMaxLevels) {
    return fail(api, ORT_INVALID_ARGUMENT, "MSDA (CUDA): " + std::to_string(t.levels) + " levels; this kernel takes " +
                                               std::to_string(kMaxLevels) + " at most");
  }
  if (t.batch * t.queries * t.heads * t.dim == 0) return nullptr;
  void* stream = nullptr;
  if (OrtStatus* status = ort::get<ort::KernelContext_GetGPUComputeStreamFn>(
          api, ort::KernelContext_GetGPUComputeStream)(context, &stream)) {
    return status;
  }
  Levels levels{};
  for (int64_t lv = 0; lv < t.levels; ++lv) {
    levels.height[lv] = t.shapes[2 * lv];
    levels.width[lv] = t.shapes[2 * lv + 1];
    levels.start[lv] = t.starts[lv];
  }
  // Wide loads and stores need every corner's and output's first channel 16-byte aligned: the tensors' starts, and
  // offsets that are multiples of kVector channels (token * M * D + head * D + a multiple of kVector: D % kVector).
  if (t.dim % kVector == 0 && aligned16(t.value) && aligned16(t.out)) {
    launch<T, U, kVector>(t, levels, static_cast<cudaStream_t>(stream));
  } else {
    launch<T, U, 1>(t, levels, static_cast<cudaStream_t>(stream));
  }
  const cudaError_t launched = cudaGetLastError();  // the launch's own error (no kernel image, bad config): no sync
  if (launched != cudaSuccess) {
    return fail(api, ORT_FAIL, std::string("MSDA (CUDA): kernel launch failed: ") + cudaGetErrorString(launched));
  }
  return nullptr;
}

// --- the OrtCustomOp callbacks ----------------------------------------------------------------------------------

OrtStatus* ORT_API_CALL create_kernel(const OrtCustomOp*, const OrtApi* api, const OrtKernelInfo*, void** kernel) {
  *kernel = new (std::nothrow) Kernel{api};
  return *kernel ? nullptr : fail(api, ORT_FAIL, "MSDA (CUDA): out of host memory creating the kernel");
}

template <typename T, typename U>
OrtStatus* ORT_API_CALL compute_kernel(void* kernel, OrtKernelContext* context) {
  const OrtApi* api = static_cast<const Kernel*>(kernel)->api;
  try {
    return compute<T, U>(api, context);
  } catch (const std::exception& e) {  // std::bad_alloc from a shape vector: nothing may unwind into onnxruntime
    return fail(api, ORT_FAIL, e.what());
  }
}

void ORT_API_CALL destroy_kernel(void* kernel) { delete static_cast<Kernel*>(kernel); }
const char* ORT_API_CALL op_provider(const OrtCustomOp*) { return "CUDAExecutionProvider"; }
// The level tables are read on the host (shape checks, kernel arguments): onnxruntime hands them over in host memory.
OrtMemType ORT_API_CALL input_memory(const OrtCustomOp*, size_t index) {
  return index == 1 || index == 2 ? OrtMemTypeCPUInput : OrtMemTypeDefault;
}

template <typename T, typename U>
OrtCustomOp make_op() {
  OrtCustomOp op = msda::op_table();
  op.GetExecutionProviderType = op_provider;
  op.GetInputType = msda::input_type<T, U>;
  op.GetOutputType = msda::output_type<T>;
  op.GetInputMemoryType = input_memory;
  op.CreateKernelV2 = create_kernel;
  op.KernelComputeV2 = compute_kernel<T, U>;
  op.KernelDestroy = destroy_kernel;
  return op;
}

// The variants msda_op.h lists, as the CPU kernel registers them.
const OrtCustomOp g_ops[] = {make_op<float, float>(), make_op<__half, float>(), make_op<__half, __half>()};

}  // namespace

size_t msda::cuda_op_count() { return sizeof(g_ops) / sizeof(g_ops[0]); }
const OrtCustomOp* msda::cuda_op(size_t index) { return &g_ops[index]; }
