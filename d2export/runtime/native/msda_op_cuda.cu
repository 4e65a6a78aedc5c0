// d2export's fused MSDA operator (d2export.MultiScaleDeformableAttention) for onnxruntime's CUDA execution provider.
//
// Built by setup.py into d2export/runtime/_msda_cuda*.so together with msda_op.cc (the CPU kernel, whose
// RegisterCustomOps adds these ops to the same domain) where nvcc exists, with cudart linked statically. Nothing here
// runs at load or registration: the ops are plain structs, so the library loads into a CPU-only onnxruntime on a
// machine without a GPU or a driver, and only a CUDA session's Compute calls into CUDA.
//
// It samples exactly as the CPU kernel (msda_sample.h: the same functions, coordinates in double, each output
// element accumulated in float in the same order; built with -fmad=false, so no multiply-add is contracted that the
// CPU kernel computes in two roundings). One thread per output element (image, query, head, channel): channels are
// the fastest index, so a warp reads a corner's D values and writes its outputs contiguously.
//
// Inputs as the CPU kernel's, value and output float32 or float16 (sampling_locations and attention_weights stay
// float32; a float16 value is accumulated in float32 and rounded once). spatial_shapes and level_start_index are CPU
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
using msda::kMaxLevels;
using msda::Levels;

struct Load {
  __device__ __forceinline__ float operator()(const float* p) const { return __ldg(p); }
  __device__ __forceinline__ float operator()(const __half* p) const { return __half2float(__ldg(p)); }
};
__device__ __forceinline__ void store(float* p, float v) { *p = v; }
__device__ __forceinline__ void store(__half* p, float v) { *p = __float2half_rn(v); }

template <typename T>
__global__ void __launch_bounds__(kThreads)
    msda_forward(const T* __restrict__ value, const float* __restrict__ loc, const float* __restrict__ attn,
                 T* __restrict__ out, const Levels levels, int64_t total, int64_t tokens, int64_t heads, int64_t dim,
                 int64_t queries, int n_levels, int64_t points) {
  const int64_t width_md = heads * dim;  // values per token, outputs per (image, query)
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t d = idx % dim;
    const int64_t row_head = idx / dim;  // (image * Lq + query) * M + head
    const int64_t h = row_head % heads;
    const int64_t row = row_head / heads;
    const T* head = value + (row / queries) * tokens * width_md + h * dim + d;
    store(out + idx, msda::element(head, loc, attn, levels, n_levels, points, row_head, width_md, Load{}));
  }
}

OrtStatus* fail(const OrtApi* api, OrtErrorCode code, const std::string& message) {
  return ort::get<ort::CreateStatusFn>(api, ort::CreateStatus)(code, message.c_str());
}

struct Kernel {
  const OrtApi* api;
};

template <typename T>
OrtStatus* compute(const OrtApi* api, OrtKernelContext* context) {
  msda::Tensors t;
  if (OrtStatus* status = msda::prepare(api, context, t)) return status;
  if (t.levels > kMaxLevels) {
    return fail(api, ORT_INVALID_ARGUMENT, "MSDA (CUDA): " + std::to_string(t.levels) + " levels; this kernel takes " +
                                               std::to_string(kMaxLevels) + " at most");
  }
  const int64_t total = t.batch * t.queries * t.heads * t.dim;
  if (total == 0) return nullptr;
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
  const int64_t blocks_needed = (total + kThreads - 1) / kThreads;
  const unsigned blocks = static_cast<unsigned>(blocks_needed < (1LL << 30) ? blocks_needed : (1LL << 30));
  msda_forward<T><<<blocks, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<const T*>(t.value), t.loc, t.attn, static_cast<T*>(t.out), levels, total, t.tokens, t.heads, t.dim,
      t.queries, static_cast<int>(t.levels), t.points);
  const cudaError_t launched = cudaGetLastError();  // the launch's own error (no kernel image, bad config): no sync
  if (launched != cudaSuccess) {
    return fail(api, ORT_FAIL, std::string("MSDA (CUDA): kernel launch failed: ") + cudaGetErrorString(launched));
  }
  return nullptr;
}

// --- the OrtCustomOp callbacks ----------------------------------------------------------------------------------
template <typename T>
struct Op;
template <>
struct Op<float> {
  static constexpr ONNXTensorElementDataType type = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
};
template <>
struct Op<__half> {
  static constexpr ONNXTensorElementDataType type = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;
};

OrtStatus* ORT_API_CALL create_kernel(const OrtCustomOp*, const OrtApi* api, const OrtKernelInfo*, void** kernel) {
  *kernel = new (std::nothrow) Kernel{api};
  return *kernel ? nullptr : fail(api, ORT_FAIL, "MSDA (CUDA): out of host memory creating the kernel");
}

template <typename T>
OrtStatus* ORT_API_CALL compute_kernel(void* kernel, OrtKernelContext* context) {
  const OrtApi* api = static_cast<const Kernel*>(kernel)->api;
  try {
    return compute<T>(api, context);
  } catch (const std::exception& e) {  // std::bad_alloc from a shape vector: nothing may unwind into onnxruntime
    return fail(api, ORT_FAIL, e.what());
  }
}

void ORT_API_CALL destroy_kernel(void* kernel) { delete static_cast<Kernel*>(kernel); }
const char* ORT_API_CALL op_provider(const OrtCustomOp*) { return "CUDAExecutionProvider"; }
template <typename T>
ONNXTensorElementDataType ORT_API_CALL input_type(const OrtCustomOp*, size_t index) {
  return index == 0 ? Op<T>::type
                    : (index == 1 || index == 2 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64 : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT);
}
template <typename T>
ONNXTensorElementDataType ORT_API_CALL output_type(const OrtCustomOp*, size_t) {
  return Op<T>::type;
}
// The level tables are read on the host (shape checks, kernel arguments): onnxruntime hands them over in host memory.
OrtMemType ORT_API_CALL input_memory(const OrtCustomOp*, size_t index) {
  return index == 1 || index == 2 ? OrtMemTypeCPUInput : OrtMemTypeDefault;
}

template <typename T>
OrtCustomOp make_op() {
  OrtCustomOp op = msda::op_table();
  op.GetExecutionProviderType = op_provider;
  op.GetInputType = input_type<T>;
  op.GetOutputType = output_type<T>;
  op.GetInputMemoryType = input_memory;
  op.CreateKernelV2 = create_kernel;
  op.KernelComputeV2 = compute_kernel<T>;
  op.KernelDestroy = destroy_kernel;
  return op;
}

const OrtCustomOp g_ops[] = {make_op<float>(), make_op<__half>()};

}  // namespace

size_t msda::cuda_op_count() { return sizeof(g_ops) / sizeof(g_ops[0]); }
const OrtCustomOp* msda::cuda_op(size_t index) { return &g_ops[index]; }
