// PicassoKeptIds: padded ids as the fused lookups read them, in one pass over the ids.
//
// A sequence of ids made sparse by tf.sparse.from_dense (or a feature column) drops its
// padding; the sparse_one_hot pass reads the padded ids instead, each weighted 1 where
// the conversion keeps it and 0 where it does not, read as id 0. As TensorFlow ops that
// is a comparison, a maximum and a cast per feature, each its own pass over the ids and
// its own kernel launch; here it is one.
//
//   kept_ids = max(ids, 0)
//   weights  = 1 where the id is kept (ids > 0, or ids >= 0 with keep_zero), else 0;
//              shaped ids.shape + [1], the weights of a lookup pooled by row
#include <algorithm>
#include <vector>

#include "picasso_common.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace tensorflow {
namespace {

// Ids a work item covers: below two items' worth the pass runs inline, as waking the
// pool costs more than it saves.
constexpr int64_t kIdsPerItem = 1 << 16;

template <typename T, typename Tid>
class KeptIdsOp : public OpKernel {
 public:
  explicit KeptIdsOp(OpKernelConstruction* c) : OpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("keep_zero", &keep_zero_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& ids = ctx->input(0);
    Tensor *kept_ids, *weights;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, ids.shape(), &kept_ids));
    TensorShape weights_shape = ids.shape();
    weights_shape.AddDim(1);
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, weights_shape, &weights));
    const Tid* in = ids.flat<Tid>().data();
    Tid* out = kept_ids->flat<Tid>().data();
    T* w = weights->flat<T>().data();
    const int64_t n = ids.NumElements();
    const Tid lowest_kept = keep_zero_ ? Tid(0) : Tid(1);
    const int64_t items = (n + kIdsPerItem - 1) / kIdsPerItem;
    ::picasso::RunWorkItems(ctx, items, items > 1, [&](int64_t item) {
      const int64_t end = std::min(n, (item + 1) * kIdsPerItem);
      for (int64_t j = item * kIdsPerItem; j < end; ++j) {
        const Tid id = in[j];
        out[j] = std::max(id, Tid(0));
        w[j] = id >= lowest_kept ? T(1) : T(0);
      }
    });
  }

 private:
  bool keep_zero_;
};

// The kept ids alone, as the conversion leaves them: the fused lookups then pool only
// them, by segment, and never read a dropped position. Two passes over the ids in work
// items of whole rows: each item counts what it keeps, then writes it where the counts of
// the items before it end.
template <typename Tid>
class KeptSegmentsOp : public OpKernel {
 public:
  explicit KeptSegmentsOp(OpKernelConstruction* c) : OpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("keep_zero", &keep_zero_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& ids = ctx->input(0);
    OP_REQUIRES(ctx, ids.dims() == 2,
                errors::InvalidArgument("PicassoKeptSegments takes ids [batch, length], got shape ",
                                        ids.shape().DebugString()));
    const int64_t rows = ids.dim_size(0), length = ids.dim_size(1);
    const Tid* in = ids.flat<Tid>().data();
    const Tid lowest_kept = keep_zero_ ? Tid(0) : Tid(1);
    const int64_t rows_per_item = std::max<int64_t>(1, kIdsPerItem / std::max<int64_t>(length, 1));
    const int64_t items = (rows + rows_per_item - 1) / rows_per_item;
    const bool parallel = items > 1;
    std::vector<int64_t> starts(items + 1, 0);
    ::picasso::RunWorkItems(ctx, items, parallel, [&](int64_t item) {
      const int64_t begin = item * rows_per_item * length;
      const int64_t end = std::min(rows, (item + 1) * rows_per_item) * length;
      int64_t kept = 0;
      for (int64_t j = begin; j < end; ++j) kept += in[j] >= lowest_kept;
      starts[item + 1] = kept;
    });
    for (int64_t item = 0; item < items; ++item) starts[item + 1] += starts[item];
    Tensor *kept_ids, *segment_ids, *num_segments;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({starts[items]}), &kept_ids));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({starts[items]}), &segment_ids));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(2, TensorShape({}), &num_segments));
    num_segments->scalar<int64_t>()() = rows;
    Tid* out = kept_ids->flat<Tid>().data();
    int64_t* segments = segment_ids->flat<int64_t>().data();
    // Every id is written and the position moves on only past a kept one: no branch on
    // the id, which mispredicts on padding mixed with ids. Once the item's last kept id is
    // written the rest of its ids are all dropped, so the writes stop before its end.
    ::picasso::RunWorkItems(ctx, items, parallel, [&](int64_t item) {
      int64_t k = starts[item];
      const int64_t stop = starts[item + 1];
      const int64_t last_row = std::min(rows, (item + 1) * rows_per_item);
      for (int64_t row = item * rows_per_item; row < last_row && k < stop; ++row) {
        const Tid* row_ids = in + row * length;
        for (int64_t j = 0; j < length && k < stop; ++j) {
          out[k] = row_ids[j];
          segments[k] = row;
          k += row_ids[j] >= lowest_kept;
        }
      }
    });
  }

 private:
  bool keep_zero_;
};

REGISTER_OP("PicassoKeptIds")
    .Input("ids: Tid")
    .Output("kept_ids: Tid")
    .Output("weights: T")
    .Attr("keep_zero: bool")
    .Attr("T: {half, bfloat16, float, double}")
    .Attr("Tid: {int32, int64}")
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      c->set_output(0, c->input(0));
      shape_inference::ShapeHandle weights;
      TF_RETURN_IF_ERROR(c->Concatenate(c->input(0), c->Vector(1), &weights));
      c->set_output(1, weights);
      return OkStatus();
    })
    .Doc(R"doc(
Padded ids read as ids: max(ids, 0), and weights ids.shape + [1] of 1 where an id is kept
(ids > 0; ids >= 0 with keep_zero) and 0 where it is not.
)doc");

REGISTER_OP("PicassoKeptSegments")
    .Input("ids: Tid")
    .Output("kept_ids: Tid")
    .Output("segment_ids: int64")
    .Output("num_segments: int64")
    .Attr("keep_zero: bool")
    .Attr("Tid: {int32, int64}")
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      shape_inference::ShapeHandle ids;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 2, &ids));
      c->set_output(0, c->Vector(c->UnknownDim()));
      c->set_output(1, c->output(0));
      c->set_output(2, c->Scalar());
      return OkStatus();
    })
    .Doc(R"doc(
Padded ids [batch, length] as the ids a conversion to a SparseTensor keeps (ids > 0; ids
>= 0 with keep_zero), in order: kept_ids, the row of each (segment_ids) and the number of
rows (num_segments).
)doc");

REGISTER_KERNEL_BUILDER(
    Name("PicassoKeptSegments").Device(DEVICE_CPU).TypeConstraint<int32>("Tid"), KeptSegmentsOp<int32>);
REGISTER_KERNEL_BUILDER(
    Name("PicassoKeptSegments").Device(DEVICE_CPU).TypeConstraint<int64_t>("Tid"), KeptSegmentsOp<int64_t>);

#define REGISTER(T, Tid)                                                                  \
  REGISTER_KERNEL_BUILDER(                                                              \
      Name("PicassoKeptIds").Device(DEVICE_CPU).TypeConstraint<T>("T").TypeConstraint<Tid>("Tid"), \
      KeptIdsOp<T, Tid>);
#define REGISTER_IDS(T) REGISTER(T, int32) REGISTER(T, int64_t)
REGISTER_IDS(Eigen::half)
REGISTER_IDS(bfloat16)
REGISTER_IDS(float)
REGISTER_IDS(double)
#undef REGISTER_IDS
#undef REGISTER

}  // namespace
}  // namespace tensorflow
