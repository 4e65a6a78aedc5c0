// What the CPU kernel's translation unit (msda_op.cc) shares with the CUDA kernel's (msda_op_cuda.cu), where the
// library is built with both (D2_MSDA_CUDA): the inputs read and checked once, the same way, and the CUDA ops that
// RegisterCustomOps adds beside the CPU one.
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "ort_abi.h"

namespace msda {

// One call's tensors, shapes checked and output created. The level tables are host memory for every kernel (the
// CUDA op declares them CPU inputs); the other pointers are in the kernel's own memory, of the element types the op
// variant that onnxruntime chose declares (value and output alike; locations and weights alike).
struct Tensors {
  const void* value;      // [N, S, M, D]
  const int64_t* shapes;  // [L, 2] (H, W)
  const int64_t* starts;  // [L]
  const void* loc;        // [N, Lq, M, L, P, 2]
  const void* attn;       // [N, Lq, M, L, P]
  void* out;              // [N, Lq, M * D]
  int64_t batch, tokens, heads, dim, queries, levels, points;
};

// OrtCustomOp version 16: the lowest with CreateKernelV2/KernelComputeV2, whose OrtStatus returns carry a bad
// input's message to the caller instead of crashing the process.
constexpr uint32_t kOpVersion = 16;

// The table every kernel of the op fills alike (msda_op.cc): its version and name, five inputs and one output, none
// optional or variadic. Each kernel sets the rest: provider, element types, input memory, kernel callbacks.
OrtCustomOp op_table();

// Reads the context's five inputs, checks their shapes (an ORT_INVALID_ARGUMENT status naming the problem) and
// creates the output: nullptr on success (msda_op.cc).
OrtStatus* prepare(const OrtApi* api, OrtKernelContext* context, Tensors& t);

// The element types of the op's variants, each registered for the CPU and (where built) the CUDA provider: value and
// output float32 with float32 locations and weights; value and output float16 with float32 locations and weights (what
// a float16 graph's fused node gets: its locations keep float32's precision); everything float16. onnxruntime picks
// the variant by the node's input types (each input's type is constrained on its own) and infers the output's type
// from it. T is a variant's value and output type, U its locations' and weights': float, or a 16-bit float type
// (its bits as uint16_t on the host, __half in CUDA); both kernels declare them through these.
template <typename T>
constexpr ONNXTensorElementDataType element_type() {
  return std::is_same_v<T, float> ? ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;
}
template <typename T, typename U>
ONNXTensorElementDataType ORT_API_CALL input_type(const OrtCustomOp*, size_t index) {
  return index == 0 ? element_type<T>() : (index == 1 || index == 2 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64
                                                                    : element_type<U>());
}
template <typename T>
ONNXTensorElementDataType ORT_API_CALL output_type(const OrtCustomOp*, size_t) {
  return element_type<T>();
}

#if defined(D2_MSDA_CUDA)
// The CUDA execution provider's ops (msda_op_cuda.cu): `cuda_op_count()` of them, the variants above.
// Declaring them calls nothing in CUDA: a library with them loads and registers without a GPU or a driver.
size_t cuda_op_count();
const OrtCustomOp* cuda_op(size_t index);
#endif

}  // namespace msda
