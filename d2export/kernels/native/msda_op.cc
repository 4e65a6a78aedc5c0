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

// As Python prints a shape tuple, so that messages read as msda_kernel.msda's do.
std::string shape_str(const std::vector<int64_t>& dims) {
  std::string s = "(";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + (dims.size() == 1 ? ",)" : ")");
}

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

// Shapes checked as msda_kernel.msda checks them; an OrtStatus naming the problem, or nullptr. The level tables
// (their contents) are read only once their shapes are known to match.
OrtStatus* check(const OrtApi* api, const std::vector<int64_t>& value, const std::vector<int64_t>& shapes,
                 const std::vector<int64_t>& starts, const std::vector<int64_t>& loc, const std::vector<int64_t>& attn,
                 const int64_t* shape_data, const int64_t* start_data) {
  if (value.size() != 4) return fail(api, "MSDA: value " + shape_str(value) + " is not [N, S, M, D]");
  const bool attn_matches = attn.size() == 5 && loc.size() == 6 && std::equal(attn.begin(), attn.end(), loc.begin());
  if (loc.size() != 6 || loc[5] != 2 || loc[0] != value[0] || loc[2] != value[2] || !attn_matches) {
    return fail(api, "MSDA: sampling_locations " + shape_str(loc) + " / attention_weights " + shape_str(attn) +
                         " do not match value " + shape_str(value) +
                         " ([N, Lq, M, L, P, 2] / [N, Lq, M, L, P] expected)");
  }
  const int64_t levels = loc[3];
  if (shapes != std::vector<int64_t>{levels, 2} || starts != std::vector<int64_t>{levels}) {
    return fail(api, "MSDA: spatial_shapes " + shape_str(shapes) + " / level_start_index " + shape_str(starts) +
                         " do not match " + std::to_string(levels) + " levels");
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
        return fail(api, "MSDA: spatial_shapes " + levels_str + "] / level_start_index " + starts_str +
                             "] hold a negative size or start");
      }
      return fail(api, "MSDA: the levels " + levels_str + "] need more tokens than value has (" +
                           std::to_string(tokens) + ") from level_start_index " + starts_str + "]");
    }
  }
  return nullptr;
}

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
  RETURN_IF_ERROR(check(api, value, dims[1], dims[2], loc, dims[4], shape_data, start_data));

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
