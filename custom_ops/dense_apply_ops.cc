// PicassoDenseApply: the Keras optimizer's update of many variables with dense
// gradients in one op (a multi-tensor, "foreach" update), matching Keras 2.15.
//
// Inputs: G variables `vars` (any shapes), their optimizer slots `slots` (num_slots
// per variable, variable by variable, each shaped like its variable), their
// gradients `grads` (each shaped like its variable) and the update's scalar
// hyper-parameters `hyper`, named by hyper_names, as the PicassoSparseApply op of
// `optimizer` takes them (sparse_apply_ops.cc). `decayed[i]`: whether Keras' decoupled
// weight decay reaches variable i (its exclude_from_weight_decay).
//
// Each element follows Keras' dense-gradient branch of update_step in Keras' float
// operation order (the Dense methods of sparse_updates.h), after the weight decay;
// the results equal Keras' except where sparse_updates.h says.
//
// Race freedom and determinism: the variables and slots are locked for the call;
// the elements of all variables are cut into blocks, each thread of TF's intra-op
// pool updates whole blocks, and an element's new value depends on that element
// only, so results do not depend on the number of threads.
#define EIGEN_USE_THREADS

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "sparse_updates.h"

namespace tensorflow {
namespace picasso {
namespace {

REGISTER_OP("PicassoDenseApply")
    .Input("vars: G * resource")
    .Input("slots: num_table_slots * resource")
    .Input("grads: G * T")
    .Input("hyper: num_hyper * T")
    .Attr("T: {float, double}")
    .Attr("G: int >= 1")
    .Attr("decayed: list(bool)")
    PICASSO_IN_PLACE_UPDATE_ATTRS
    .SetIsStateful()
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      std::vector<shape_inference::ShapeHandle> hyper;
      TF_RETURN_IF_ERROR(c->input("hyper", &hyper));
      shape_inference::ShapeHandle unused;
      for (const auto& h : hyper) TF_RETURN_IF_ERROR(c->WithRank(h, 0, &unused));
      return OkStatus();
    });

// Elements per block of work: large enough to amortise a task, small enough that a
// few large variables still spread over the pool.
constexpr int64_t kBlock = 1 << 14;

template <typename T>
class DenseApplyOp : public OpKernel {
 public:
  explicit DenseApplyOp(OpKernelConstruction* c) : OpKernel(c), updates_(c) {
    OP_REQUIRES_OK(c, c->GetAttr("decayed", &decayed_));
    int num_vars;
    OP_REQUIRES_OK(c, c->GetAttr("G", &num_vars));
    OP_REQUIRES(c, static_cast<int>(decayed_.size()) == num_vars,
                errors::InvalidArgument("PicassoDenseApply: `decayed` has ", decayed_.size(),
                                        " entries for ", num_vars, " variables"));
  }

  void Compute(OpKernelContext* ctx) override {
    typename InPlaceUpdates<T>::Locked locked;
    OP_REQUIRES_OK(ctx, locked.Lock(ctx, updates_));
    OpInputList grads;
    OP_REQUIRES_OK(ctx, ctx->input_list("grads", &grads));
    struct Block {
      int var;
      int64_t begin, end;
    };
    std::vector<Block> blocks;
    std::vector<const T*> grad_data;
    for (int t = 0; t < grads.size(); ++t) {
      const Tensor& var = locked.tensors()[t];
      OP_REQUIRES(ctx, grads[t].shape() == var.shape(),
                  errors::InvalidArgument("PicassoDenseApply: the gradient of variable ", t, " (",
                                          requested_input(t), ") has shape ",
                                          grads[t].shape().DebugString(), ", the variable ",
                                          var.shape().DebugString()));
      grad_data.push_back(grads[t].flat<T>().data());
      for (int64_t begin = 0; begin < var.NumElements(); begin += kBlock) {
        blocks.push_back({t, begin, std::min(begin + kBlock, var.NumElements())});
      }
    }
    auto* workers = ctx->device()->tensorflow_cpu_worker_threads()->workers;
    OP_REQUIRES_OK(ctx, locked.RunDense(ctx, [&](const auto& apply, int64_t cost) {
      workers->ParallelFor(static_cast<int64_t>(blocks.size()), cost * kBlock,
                           [&](int64_t first, int64_t last) {
        for (int64_t b = first; b < last; ++b) {
          const Block& block = blocks[b];
          apply(block.var, block.begin, block.end, grad_data[block.var] + block.begin,
                decayed_[block.var]);
        }
      });
    }));
  }

 private:
  InPlaceUpdates<T> updates_;
  std::vector<bool> decayed_;
};

REGISTER_KERNEL_BUILDER(Name("PicassoDenseApply").Device(DEVICE_CPU).TypeConstraint<float>("T"),
                        DenseApplyOp<float>);
REGISTER_KERNEL_BUILDER(Name("PicassoDenseApply").Device(DEVICE_CPU).TypeConstraint<double>("T"),
                        DenseApplyOp<double>);

}  // namespace
}  // namespace picasso
}  // namespace tensorflow
