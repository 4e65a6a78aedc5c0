// d2export's fused MSDA operator (d2export.MultiScaleDeformableAttention) as a native onnxruntime custom-op library.
//
// onnxruntime loads it with SessionOptions.register_custom_ops_library(path) (C++: RegisterCustomOpsLibrary) and
// calls RegisterCustomOps. It computes what d2export/kernels/numba_msda.py (numba) computes: exact bilinear sampling
// with zero padding and align_corners=False, as Deformable-DETR's CUDA op; corners outside a level weigh 0; a point
// whose whole footprint is outside (or NaN) contributes nothing; pixel coordinates in double, each output row
// accumulated in float. Rows (image, query) run on the session's intra-op threads (KernelContext_ParallelFor), so the
// library has no thread pool of its own and needs no Python.
//
// inputs  value [N, S, M, D] T, spatial_shapes [L, 2] int64 (H, W), level_start_index [L] int64,
//         sampling_locations [N, Lq, M, L, P, 2] U (x, y in [0, 1]), attention_weights [N, Lq, M, L, P] U
// output  [N, Lq, M * D] T
// (T, U): (float, float), (float16, float), (float16, float16): float16 read as float16, summed in float, the output
// rounded once.
#include <algorithm>
#include <cmath>
#include <exception>
#include <functional>
#include <mutex>
#include <string>
#include <type_traits>
#include <vector>

#include "msda_op.h"
#include "msda_rows.h"
#include "msda_sample.h"
#include "ort_abi.h"

namespace {

using msda::kOpVersion;
// OrtApi version 17 (onnxruntime 1.17): the lowest with KernelContext_ParallelFor, the newest entry used. On an older
// runtime the library asks for 16 and computes on the calling thread alone.
constexpr uint32_t kApiVersion = 17;

const char* const kDomain = "d2export";
const char* const kName = "MultiScaleDeformableAttention";

// What RegisterCustomOps sets up once per process. The domain is shared by every SessionOptions the library is
// registered with and never released: sessions may use it until the process ends.
struct Runtime {
  const OrtApi* api = nullptr;
  bool parallel = false;  // KernelContext_ParallelFor is there
  OrtCustomOpDomain* domain = nullptr;
  std::string error;  // why `domain` is null
};

Runtime g_runtime;  // written once under std::call_once, before any session can create a kernel
std::once_flag g_once;

OrtStatus* fail(const OrtApi* api, const std::string& message) {
  return ort::get<ort::CreateStatusFn>(api, ort::CreateStatus)(ORT_INVALID_ARGUMENT, message.c_str());
}

#define RETURN_IF_ERROR(expr)          \
  do {                                 \
    if (OrtStatus* status_ = (expr)) { \
      return status_;                  \
    }                                  \
  } while (0)

// The dimensions of a tensor input.
OrtStatus* dims_of(const OrtApi* api, const OrtValue* value, std::vector<int64_t>& dims) {
  OrtTensorTypeAndShapeInfo* info = nullptr;
  RETURN_IF_ERROR(ort::get<ort::GetTensorTypeAndShapeFn>(api, ort::GetTensorTypeAndShape)(value, &info));
  size_t count = 0;
  OrtStatus* status = ort::get<ort::GetDimensionsCountFn>(api, ort::GetDimensionsCount)(info, &count);
  if (!status) {
    dims.assign(count, 0);
    status = ort::get<ort::GetDimensionsFn>(api, ort::GetDimensions)(info, dims.data(), count);
  }
  ort::get<ort::ReleaseTensorTypeAndShapeInfoFn>(api, ort::ReleaseTensorTypeAndShapeInfo)(info);
  return status;
}


using msda_rows::Half;
using msda_rows::Problem;
using msda_rows::row_task;


}  // namespace

// Declared in msda_op.h: the CUDA kernel reads its inputs through this too.
OrtStatus* msda::prepare(const OrtApi* api, OrtKernelContext* context, msda::Tensors& t) {
  const OrtValue* inputs[5];
  std::vector<int64_t> dims[5];
  void* data[5];
  for (size_t k = 0; k < 5; ++k) {
    RETURN_IF_ERROR(ort::get<ort::KernelContext_GetInputFn>(api, ort::KernelContext_GetInput)(context, k, &inputs[k]));
    RETURN_IF_ERROR(dims_of(api, inputs[k], dims[k]));
    // Inputs are only read; the C API hands out their data through the one mutable getter that every version has.
    RETURN_IF_ERROR(ort::get<ort::GetTensorMutableDataFn>(api, ort::GetTensorMutableData)(
        const_cast<OrtValue*>(inputs[k]), &data[k]));
  }
  const auto& value = dims[0];
  const auto& loc = dims[3];
  const int64_t* shape_data = static_cast<const int64_t*>(data[1]);
  const int64_t* start_data = static_cast<const int64_t*>(data[2]);
  const std::string problem = msda_rows::problem_with(value, dims[1], dims[2], loc, dims[4], shape_data, start_data);
  if (!problem.empty()) return fail(api, problem);

  const int64_t out_dims[3] = {value[0], loc[1], value[2] * value[3]};
  OrtValue* output = nullptr;
  RETURN_IF_ERROR(ort::get<ort::KernelContext_GetOutputFn>(api, ort::KernelContext_GetOutput)(context, 0, out_dims, 3,
                                                                                              &output));
  void* out_data = nullptr;
  RETURN_IF_ERROR(ort::get<ort::GetTensorMutableDataFn>(api, ort::GetTensorMutableData)(output, &out_data));
  t = msda::Tensors{data[0], shape_data, start_data, data[3], data[4], out_data, value[0], value[1], value[2], value[3],
                    loc[1], loc[3], loc[4]};
  return nullptr;
}

namespace {

template <typename T, typename U>
OrtStatus* compute(const Runtime& rt, OrtKernelContext* context) {
  const OrtApi* api = rt.api;
  msda::Tensors t;
  RETURN_IF_ERROR(msda::prepare(api, context, t));
  Problem<T, U> problem{static_cast<const T*>(t.value), t.shapes, t.starts, static_cast<const U*>(t.loc),
                        static_cast<const U*>(t.attn), static_cast<T*>(t.out), t.tokens, t.heads, t.dim, t.queries,
                        t.levels, t.points};
  const size_t rows = static_cast<size_t>(t.batch * t.queries);
  if (rows == 0 || t.heads * t.dim == 0) return nullptr;
  void (*task)(void*, size_t) = row_task<T, U>;
  if (rt.parallel) {
    // num_batch 0: onnxruntime hands rows to its threads as they come free (rows cost alike, but threads do not
    // run alike on a shared machine).
    return ort::get<ort::KernelContext_ParallelForFn>(api, ort::KernelContext_ParallelFor)(context, task, rows, 0,
                                                                                          &problem);
  }
  for (size_t row = 0; row < rows; ++row) task(&problem, row);
  return nullptr;
}

// --- the OrtCustomOp callbacks ----------------------------------------------------------------------------------
OrtStatus* ORT_API_CALL create_kernel(const OrtCustomOp*, const OrtApi*, const OrtKernelInfo*, void** kernel) {
  *kernel = &g_runtime;  // no state of its own: every kernel computes with the registered runtime
  return nullptr;
}

template <typename T, typename U>
OrtStatus* ORT_API_CALL compute_kernel(void* kernel, OrtKernelContext* context) {
  const Runtime& rt = *static_cast<const Runtime*>(kernel);
  try {
    return compute<T, U>(rt, context);
  } catch (const std::exception& e) {  // std::bad_alloc from a shape vector: nothing may unwind into onnxruntime
    return ort::get<ort::CreateStatusFn>(rt.api, ort::CreateStatus)(ORT_FAIL, e.what());
  }
}

void ORT_API_CALL destroy_kernel(void*) {}
const char* ORT_API_CALL op_name(const OrtCustomOp*) { return kName; }
const char* ORT_API_CALL op_provider(const OrtCustomOp*) { return nullptr; }  // the CPU provider
size_t ORT_API_CALL input_count(const OrtCustomOp*) { return 5; }
size_t ORT_API_CALL output_count(const OrtCustomOp*) { return 1; }
OrtCustomOpInputOutputCharacteristic ORT_API_CALL required(const OrtCustomOp*, size_t) {
  return INPUT_OUTPUT_REQUIRED;
}
int ORT_API_CALL min_arity(const OrtCustomOp*) { return 1; }    // no variadic inputs or outputs: never asked
int ORT_API_CALL homogeneous(const OrtCustomOp*) { return 1; }  // likewise
OrtMemType ORT_API_CALL input_memory(const OrtCustomOp*, size_t) { return OrtMemTypeDefault; }

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

// The variants msda_op.h lists, in its order: onnxruntime picks one by the node's input types.
const OrtCustomOp g_ops[] = {make_op<float, float>(), make_op<Half, float>(), make_op<Half, Half>()};

void set_up(const OrtApiBase* base, Runtime& rt) {
  rt.api = base->GetApi(kApiVersion);
  rt.parallel = rt.api != nullptr;
  if (!rt.api) rt.api = base->GetApi(kOpVersion);
  if (!rt.api) return;
  OrtCustomOpDomain* domain = nullptr;
  OrtStatus* status = ort::get<ort::CreateCustomOpDomainFn>(rt.api, ort::CreateCustomOpDomain)(kDomain, &domain);
  for (size_t k = 0; !status && k < sizeof(g_ops) / sizeof(g_ops[0]); ++k) {
    status = ort::get<ort::CustomOpDomain_AddFn>(rt.api, ort::CustomOpDomain_Add)(domain, &g_ops[k]);
  }
#if defined(D2_MSDA_CUDA)
  // The same operator for the CUDA execution provider, in the same domain (onnxruntime picks the kernel by the
  // node's provider and types). A session without that provider never creates them.
  for (size_t k = 0; !status && k < msda::cuda_op_count(); ++k) {
    status = ort::get<ort::CustomOpDomain_AddFn>(rt.api, ort::CustomOpDomain_Add)(domain, msda::cuda_op(k));
  }
#endif
  if (!status) {
    rt.domain = domain;
    return;
  }
  // Kept as text: every later registration answers with a status of its own.
  rt.error = std::string("d2export MSDA: could not declare the operator: ") +
             ort::get<ort::GetErrorMessageFn>(rt.api, ort::GetErrorMessage)(status);
  ort::get<ort::ReleaseStatusFn>(rt.api, ort::ReleaseStatus)(status);
  if (domain) ort::get<ort::ReleaseCustomOpDomainFn>(rt.api, ort::ReleaseCustomOpDomain)(domain);
}

}  // namespace

OrtCustomOp msda::op_table() {
  OrtCustomOp op{};  // every field null, the later versions' ones included
  op.version = kOpVersion;
  op.GetName = op_name;
  op.GetInputTypeCount = input_count;
  op.GetOutputTypeCount = output_count;
  op.GetInputCharacteristic = required;
  op.GetOutputCharacteristic = required;
  op.GetVariadicInputMinArity = min_arity;
  op.GetVariadicInputHomogeneity = homogeneous;
  op.GetVariadicOutputMinArity = min_arity;
  op.GetVariadicOutputHomogeneity = homogeneous;
  return op;
}

extern "C" D2_EXPORT OrtStatus* ORT_API_CALL RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* base) {
  std::call_once(g_once, set_up, base, std::ref(g_runtime));
  if (!g_runtime.api) {
    const std::string message = "d2export's MSDA library needs onnxruntime 1.16 or newer (C API version " +
                                std::to_string(kOpVersion) + "); this is onnxruntime " + base->GetVersionString();
    const OrtApi* oldest = base->GetApi(1);  // every runtime has version 1, and CreateStatus in it
    return oldest ? ort::get<ort::CreateStatusFn>(oldest, ort::CreateStatus)(ORT_FAIL, message.c_str()) : nullptr;
  }
  if (!g_runtime.domain) return fail(g_runtime.api, g_runtime.error);
  return ort::get<ort::AddCustomOpDomainFn>(g_runtime.api, ort::AddCustomOpDomain)(options, g_runtime.domain);
}
