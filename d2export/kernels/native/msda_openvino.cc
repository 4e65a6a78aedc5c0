// d2export's fused MSDA operator (d2export.MultiScaleDeformableAttention) as an OpenVINO extension library.
//
// OpenVINO loads it with Core.add_extension(path): the ONNX frontend then reads the d2export-domain node of a graph
// written with export.sampler=fused, and the CPU plugin runs it through `evaluate`. It computes the rows of the
// onnxruntime library (msda_rows.h, the same bits for the same float32 inputs), so a graph served by OpenVINO in
// bfloat16 samples as onnxruntime's float32 graph does; only its inputs arrive as OpenVINO computed them. The
// plugin hands the operator float32 (a node it runs through `evaluate` keeps the precision it declares), and
// the rows run on oneTBB, whose arena the plugin has sized to its INFERENCE_NUM_THREADS.
//
// inputs  value [N, S, M, D] float32, spatial_shapes [L, 2] int64 (H, W), level_start_index [L] int64,
//         sampling_locations [N, Lq, M, L, P, 2] float32 (x, y in [0, 1]), attention_weights [N, Lq, M, L, P] float32
// output  [N, Lq, M * D] float32
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <openvino/core/extension.hpp>
#include <openvino/core/op_extension.hpp>
#include <openvino/frontend/onnx/extension/op.hpp>
#include <openvino/op/op.hpp>
#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>

#include "msda_rows.h"

namespace d2export_openvino {

std::vector<int64_t> dims_of(const ov::Shape& shape) { return std::vector<int64_t>(shape.begin(), shape.end()); }

// A level table (spatial_shapes, level_start_index) as int64: the graph's int64, which the CPU plugin may hand over
// as int32 (it computes integer tensors in int32).
std::vector<int64_t> level_table(const ov::Tensor& t) {
  const size_t n = t.get_size();
  if (t.get_element_type() == ov::element::i64) {
    return std::vector<int64_t>(t.data<const int64_t>(), t.data<const int64_t>() + n);
  }
  OPENVINO_ASSERT(t.get_element_type() == ov::element::i32, "MSDA (OpenVINO): a level table is ", t.get_element_type(),
                  ", int64 expected");
  return std::vector<int64_t>(t.data<const int32_t>(), t.data<const int32_t>() + n);
}

class MultiScaleDeformableAttention : public ov::op::Op {
 public:
  OPENVINO_OP("MultiScaleDeformableAttention", "d2export");

  MultiScaleDeformableAttention() = default;
  explicit MultiScaleDeformableAttention(const ov::OutputVector& inputs) : Op(inputs) {
    constructor_validate_and_infer_types();
  }

  void validate_and_infer_types() override {
    NODE_VALIDATION_CHECK(this, get_input_size() == 5, "MSDA takes 5 inputs, got ", get_input_size());
    const auto& value = get_input_partial_shape(0);
    const auto& loc = get_input_partial_shape(3);
    ov::PartialShape out = ov::PartialShape::dynamic(3);
    if (value.rank().is_static() && loc.rank().is_static() && value.size() == 4 && loc.size() == 6) {
      out = ov::PartialShape{value[0], loc[1], value[2] * value[3]};
    }
    set_output_type(0, get_input_element_type(0), out);
  }

  std::shared_ptr<ov::Node> clone_with_new_inputs(const ov::OutputVector& inputs) const override {
    return std::make_shared<MultiScaleDeformableAttention>(inputs);
  }

  bool visit_attributes(ov::AttributeVisitor&) override { return true; }

  bool has_evaluate() const override { return get_input_element_type(0) == ov::element::f32; }

  bool evaluate(ov::TensorVector& outputs, const ov::TensorVector& inputs) const override {
    for (size_t k : {0, 3, 4}) {
      OPENVINO_ASSERT(inputs[k].get_element_type() == ov::element::f32, "MSDA (OpenVINO): input ", k, " is ",
                      inputs[k].get_element_type(), ", float32 expected");
    }
    const auto value = dims_of(inputs[0].get_shape()), loc = dims_of(inputs[3].get_shape());
    const std::vector<int64_t> shape_table = level_table(inputs[1]), start_table = level_table(inputs[2]);
    const int64_t* shapes = shape_table.data();
    const int64_t* starts = start_table.data();
    const std::string problem =
        msda_rows::problem_with(value, dims_of(inputs[1].get_shape()), dims_of(inputs[2].get_shape()), loc,
                                dims_of(inputs[4].get_shape()), shapes, starts);
    OPENVINO_ASSERT(problem.empty(), problem);
    outputs[0].set_shape(ov::Shape{static_cast<size_t>(value[0]), static_cast<size_t>(loc[1]),
                                   static_cast<size_t>(value[2] * value[3])});
    const msda_rows::Problem<float, float> p{inputs[0].data<const float>(), shapes, starts,
                                             inputs[3].data<const float>(), inputs[4].data<const float>(),
                                             outputs[0].data<float>(), value[1], value[2], value[3], loc[1], loc[3],
                                             loc[4]};
    const int64_t rows = value[0] * loc[1];
    if (rows == 0 || value[2] * value[3] == 0) return true;
    tbb::parallel_for(tbb::blocked_range<int64_t>(0, rows), [&p](const tbb::blocked_range<int64_t>& range) {
      for (int64_t row = range.begin(); row < range.end(); ++row) msda_rows::float_row(p, row);
    });
    return true;
  }
};

}  // namespace d2export_openvino

OPENVINO_CREATE_EXTENSIONS(std::vector<ov::Extension::Ptr>({
    std::make_shared<ov::OpExtension<d2export_openvino::MultiScaleDeformableAttention>>(),
    std::make_shared<ov::frontend::onnx::OpExtension<d2export_openvino::MultiScaleDeformableAttention>>(
        "MultiScaleDeformableAttention", "d2export"),
}));
