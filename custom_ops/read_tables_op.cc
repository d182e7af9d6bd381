// PicassoReadTables: the values of a group's table variables, read by one op instead
// of one ReadVariableOp per table (a group of a wide model holds hundreds).
//
// Each output aliases its variable's buffer, as ReadVariableOp does outside TF's
// copy-on-read mode. Unlike ReadVariableOp it aliases in that mode too (which Keras'
// own sparse updates or gathers switch a variable into, for good): there every read
// would otherwise copy the whole table. That is safe in a training step, whose
// lookups and gradients consume the values before any update of the tables runs
// (the updates depend on the gradients); and picasso's own updates copy a buffer that
// a read still holds before writing (sparse_updates.h, LockedVariables::Tensors).
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/resource_var.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace tensorflow {
namespace {

class ReadTablesOp : public OpKernel {
 public:
  explicit ReadTablesOp(OpKernelConstruction* c) : OpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("dtype", &dtype_));
  }

  void Compute(OpKernelContext* ctx) override {
    for (int i = 0; i < num_inputs(); ++i) {
      core::RefCountPtr<Var> var;
      OP_REQUIRES_OK(ctx, LookupResource(ctx, HandleFromInput(ctx, i), &var));
      tf_shared_lock lock(*var->mu());
      OP_REQUIRES(ctx, var->is_initialized,
                  errors::FailedPrecondition("PicassoReadTables: table ", i, " (",
                                             requested_input(i), ") is not initialized"));
      OP_REQUIRES(ctx, var->tensor()->dtype() == dtype_,
                  errors::InvalidArgument("PicassoReadTables: table ", i, " has dtype ",
                                          DataTypeString(var->tensor()->dtype()), ", expected ",
                                          DataTypeString(dtype_)));
      ctx->set_output(i, *var->tensor());
    }
  }

 private:
  DataType dtype_;
};

REGISTER_OP("PicassoReadTables")
    .Input("tables: G * resource")
    .Output("values: G * dtype")
    .Attr("G: int >= 1")
    .Attr("dtype: type")
    .SetIsStateful()
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      for (int i = 0; i < c->num_inputs(); ++i) {
        const auto* handle_data = c->input_handle_shapes_and_types(i);
        c->set_output(i, handle_data != nullptr && handle_data->size() == 1 ? (*handle_data)[0].shape
                                                                          : c->UnknownShape());
      }
      return OkStatus();
    })
    .Doc(R"doc(
The current values of G variables of one dtype, each aliasing its variable's buffer.
)doc");

REGISTER_KERNEL_BUILDER(Name("PicassoReadTables").Device(DEVICE_CPU), ReadTablesOp);

}  // namespace
}  // namespace tensorflow
