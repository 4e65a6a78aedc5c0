// The slice of onnxruntime's C ABI that d2export's custom-op library uses, declared here because no onnxruntime
// headers are installable where d2export builds. The C API is append-only and ABI-stable: OrtApi is a table of
// function pointers whose positions never change, and OrtCustomOp gains fields only at its end, each read by
// onnxruntime only when the op's `version` says the library knows it. So an entry is named by its position in
// upstream's `struct OrtApi` (include/onnxruntime/core/session/onnxruntime_c_api.h), counted member by member with
// comments and preprocessor lines stripped (two counts agreed: 425 members in the API 29 header).
#pragma once

#include <cstddef>
#include <cstdint>

#if defined(_WIN32)
#define ORT_API_CALL __stdcall
#define D2_EXPORT __declspec(dllexport)
#else
#define ORT_API_CALL
#define D2_EXPORT __attribute__((visibility("default")))
#endif

extern "C" {

// Opaque handles: only ever passed back to onnxruntime.
struct OrtApi;
struct OrtStatus;
struct OrtValue;
struct OrtSessionOptions;
struct OrtCustomOpDomain;
struct OrtKernelInfo;
struct OrtKernelContext;
struct OrtTensorTypeAndShapeInfo;
struct OrtShapeInferContext;

// Enumerations: only the values used here; they are the ABI's integers (TensorProto's data types, etc.).
enum ONNXTensorElementDataType {
  ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT = 1,
  ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64 = 7,
  ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16 = 10,
};
enum OrtErrorCode { ORT_OK = 0, ORT_FAIL = 1, ORT_INVALID_ARGUMENT = 2 };
// OrtMemTypeCPUInput: an input a non-CPU provider's kernel reads from host memory (onnxruntime copies it there only
// where its producer ran elsewhere).
enum OrtMemType { OrtMemTypeCPUInput = -2, OrtMemTypeDefault = 0 };
enum OrtCustomOpInputOutputCharacteristic { INPUT_OUTPUT_REQUIRED = 0 };

struct OrtApiBase {
  const OrtApi*(ORT_API_CALL* GetApi)(uint32_t version) noexcept;  // nullptr when the runtime is older than `version`
  const char*(ORT_API_CALL* GetVersionString)() noexcept;
};

// Fields in upstream's order. Which ones onnxruntime reads depends on `version`: the characteristics from 8 (though
// some versions call them unconditionally, so they must be set), GetInputMemoryType above 12, the variadic queries
// from 14, CreateKernelV2/KernelComputeV2 from 16 (used instead of CreateKernel/KernelCompute when set), shape
// inference and opset ranges from 17, in-place/alias maps later still.
struct OrtCustomOp {
  uint32_t version;
  void*(ORT_API_CALL* CreateKernel)(const OrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info);
  const char*(ORT_API_CALL* GetName)(const OrtCustomOp* op);
  const char*(ORT_API_CALL* GetExecutionProviderType)(const OrtCustomOp* op);  // nullptr: the CPU provider
  ONNXTensorElementDataType(ORT_API_CALL* GetInputType)(const OrtCustomOp* op, size_t index);
  size_t(ORT_API_CALL* GetInputTypeCount)(const OrtCustomOp* op);
  ONNXTensorElementDataType(ORT_API_CALL* GetOutputType)(const OrtCustomOp* op, size_t index);
  size_t(ORT_API_CALL* GetOutputTypeCount)(const OrtCustomOp* op);
  void(ORT_API_CALL* KernelCompute)(void* kernel, OrtKernelContext* context);
  void(ORT_API_CALL* KernelDestroy)(void* kernel);
  // version 8
  OrtCustomOpInputOutputCharacteristic(ORT_API_CALL* GetInputCharacteristic)(const OrtCustomOp* op, size_t index);
  OrtCustomOpInputOutputCharacteristic(ORT_API_CALL* GetOutputCharacteristic)(const OrtCustomOp* op, size_t index);
  // version 13
  OrtMemType(ORT_API_CALL* GetInputMemoryType)(const OrtCustomOp* op, size_t index);
  // version 14
  int(ORT_API_CALL* GetVariadicInputMinArity)(const OrtCustomOp* op);
  int(ORT_API_CALL* GetVariadicInputHomogeneity)(const OrtCustomOp* op);
  int(ORT_API_CALL* GetVariadicOutputMinArity)(const OrtCustomOp* op);
  int(ORT_API_CALL* GetVariadicOutputHomogeneity)(const OrtCustomOp* op);
  // version 16
  OrtStatus*(ORT_API_CALL* CreateKernelV2)(const OrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info,
                                           void** kernel);
  OrtStatus*(ORT_API_CALL* KernelComputeV2)(void* kernel, OrtKernelContext* context);
  // Later fields, declared only so that the struct is as long as a newer runtime's: left null, and not read at the
  // version this library sets.
  OrtStatus*(ORT_API_CALL* InferOutputShapeFn)(const OrtCustomOp* op, OrtShapeInferContext* context);
  int(ORT_API_CALL* GetStartVersion)(const OrtCustomOp* op);
  int(ORT_API_CALL* GetEndVersion)(const OrtCustomOp* op);
  size_t(ORT_API_CALL* GetMayInplace)(int** input_index, int** output_index);
  void(ORT_API_CALL* ReleaseMayInplace)(int* input_index, int* output_index);
  size_t(ORT_API_CALL* GetAliasMap)(int** input_index, int** output_index);
  void(ORT_API_CALL* ReleaseAliasMap)(int* input_index, int* output_index);
};

}  // extern "C"

namespace ort {

// Position of each OrtApi entry used here in upstream's struct, and the API version that introduced it.
enum Entry : size_t {
  CreateStatus = 0,                  // v1
  GetErrorMessage = 2,               // v1
  CreateCustomOpDomain = 26,         // v1
  CustomOpDomain_Add = 27,           // v1
  AddCustomOpDomain = 28,            // v1
  GetTensorMutableData = 51,         // v1
  GetDimensionsCount = 61,           // v1
  GetDimensions = 62,                // v1
  GetTensorTypeAndShape = 65,        // v1
  KernelContext_GetInput = 90,       // v1
  KernelContext_GetOutput = 91,      // v1
  ReleaseStatus = 93,                // v1 (ORT_CLASS_RELEASE(Status))
  ReleaseTensorTypeAndShapeInfo = 99,  // v1 (ORT_CLASS_RELEASE(TensorTypeAndShapeInfo))
  ReleaseCustomOpDomain = 101,       // v1 (ORT_CLASS_RELEASE(CustomOpDomain))
  // v10 (onnxruntime 1.10): upstream's onnxruntime_c_api.cc asserts GetSparseTensorIndices at 191, the end of v9; v10
  // opens with HasValue (192), then this.
  KernelContext_GetGPUComputeStream = 193,
  KernelContext_ParallelFor = 274,   // v17 (onnxruntime 1.17)
};

// Signatures of those entries (every status-returning one: nullptr on success).
using CreateStatusFn = OrtStatus*(ORT_API_CALL*)(OrtErrorCode code, const char* message) noexcept;
using GetErrorMessageFn = const char*(ORT_API_CALL*)(const OrtStatus* status) noexcept;
using ReleaseStatusFn = void(ORT_API_CALL*)(OrtStatus* status) noexcept;
using ReleaseCustomOpDomainFn = void(ORT_API_CALL*)(OrtCustomOpDomain* domain) noexcept;
using CreateCustomOpDomainFn = OrtStatus*(ORT_API_CALL*)(const char* domain, OrtCustomOpDomain** out) noexcept;
using CustomOpDomain_AddFn = OrtStatus*(ORT_API_CALL*)(OrtCustomOpDomain* domain, const OrtCustomOp* op) noexcept;
using AddCustomOpDomainFn = OrtStatus*(ORT_API_CALL*)(OrtSessionOptions* options, OrtCustomOpDomain* domain) noexcept;
using GetTensorMutableDataFn = OrtStatus*(ORT_API_CALL*)(OrtValue* value, void** out) noexcept;
using GetDimensionsCountFn = OrtStatus*(ORT_API_CALL*)(const OrtTensorTypeAndShapeInfo* info, size_t* out) noexcept;
using GetDimensionsFn = OrtStatus*(ORT_API_CALL*)(const OrtTensorTypeAndShapeInfo* info, int64_t* dims,
                                                  size_t count) noexcept;
using GetTensorTypeAndShapeFn = OrtStatus*(ORT_API_CALL*)(const OrtValue* value,
                                                          OrtTensorTypeAndShapeInfo** out) noexcept;
using KernelContext_GetInputFn = OrtStatus*(ORT_API_CALL*)(const OrtKernelContext* context, size_t index,
                                                           const OrtValue** out) noexcept;
using KernelContext_GetOutputFn = OrtStatus*(ORT_API_CALL*)(OrtKernelContext* context, size_t index,
                                                            const int64_t* dims, size_t count, OrtValue** out) noexcept;
using ReleaseTensorTypeAndShapeInfoFn = void(ORT_API_CALL*)(OrtTensorTypeAndShapeInfo* info) noexcept;
// The provider's compute stream (a cudaStream_t for the CUDA provider; nullptr where it has none).
using KernelContext_GetGPUComputeStreamFn = OrtStatus*(ORT_API_CALL*)(const OrtKernelContext* context,
                                                                      void** out) noexcept;
using KernelContext_ParallelForFn = OrtStatus*(ORT_API_CALL*)(const OrtKernelContext* context,
                                                              void (*fn)(void* data, size_t index), size_t total,
                                                              size_t num_batch, void* data) noexcept;

// The entry at `index` of the table `api`, as the function type F.
template <typename F>
inline F get(const OrtApi* api, Entry index) {
  using Slot = void (*)();
  return reinterpret_cast<F>(reinterpret_cast<const Slot*>(api)[index]);
}

}  // namespace ort
