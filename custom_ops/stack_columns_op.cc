// PicassoStackColumns: N tables of the same rows side by side, as one table whose row r
// holds row r of each table in turn (same-ids stacking, picasso_tf/passes/
// same_ids_stacking.py). One pass over the rows: TensorFlow's ConcatV2 along the columns
// copies each input's row apart, which on width-1 tables costs a call per element.
#include <algorithm>
#include <vector>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/util/work_sharder.h"

namespace tensorflow {
namespace {

// Rows [begin, end) of n tables of width W each, side by side into dst.
template <int W, typename T>
void CopyRows(const std::vector<const T*>& tables, int n, int64_t begin, int64_t end, T* dst) {
  for (int64_t r = begin; r < end; ++r) {
    T* row = dst + r * n * W;
    for (int i = 0; i < n; ++i) {
      const T* src = tables[i] + r * W;
      for (int c = 0; c < W; ++c) row[i * W + c] = src[c];
    }
  }
}

template <typename T>
class StackColumnsOp : public OpKernel {
 public:
  explicit StackColumnsOp(OpKernelConstruction* c) : OpKernel(c) {}

  void Compute(OpKernelContext* ctx) override {
    const int n = num_inputs();
    OP_REQUIRES(ctx, ctx->input(0).dims() == 2,
                errors::InvalidArgument("PicassoStackColumns: table 0 has shape ",
                                        ctx->input(0).shape().DebugString(), "; tables have 2 dimensions"));
    const int64_t rows = ctx->input(0).dim_size(0);
    std::vector<const T*> tables(n);
    std::vector<int64_t> widths(n);
    int64_t width = 0;
    for (int i = 0; i < n; ++i) {
      const Tensor& t = ctx->input(i);
      OP_REQUIRES(ctx, t.dims() == 2 && t.dim_size(0) == rows,
                  errors::InvalidArgument("PicassoStackColumns: table ", i, " has shape ",
                                          t.shape().DebugString(), "; every table needs ", rows,
                                          " rows and 2 dimensions"));
      tables[i] = t.flat<T>().data();
      widths[i] = t.dim_size(1);
      width += widths[i];
    }
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({rows, width}), &out));
    T* dst = out->flat<T>().data();
    const auto& workers = *ctx->device()->tensorflow_cpu_worker_threads();
    const int64_t cost = width * sizeof(T) * 2;   // bytes read and written per row
    const bool same = std::all_of(widths.begin(), widths.end(), [&](int64_t w) { return w == widths[0]; });
    // Tables a few columns wide (MLR's are one): a row's copy is a handful of elements,
    // so the loop must not pay a call or a width lookup per row.
    if (same && widths[0] == 1) {
      Shard(workers.num_threads, workers.workers, rows, cost, [&](int64_t begin, int64_t end) {
        CopyRows<1>(tables, n, begin, end, dst);
      });
    } else if (same && widths[0] == 4) {
      Shard(workers.num_threads, workers.workers, rows, cost, [&](int64_t begin, int64_t end) {
        CopyRows<4>(tables, n, begin, end, dst);
      });
    } else {
      Shard(workers.num_threads, workers.workers, rows, cost, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
          T* row = dst + r * width;
          for (int i = 0; i < n; ++i) row = std::copy_n(tables[i] + r * widths[i], widths[i], row);
        }
      });
    }
  }
};

REGISTER_OP("PicassoStackColumns")
    .Input("tables: N * T")
    .Output("stacked: T")
    .Attr("N: int >= 1")
    .Attr("T: {float, double}")   // the stitched lookup's dtypes
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      shape_inference::ShapeHandle first;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 2, &first));
      shape_inference::DimensionHandle rows = c->Dim(first, 0), width = c->MakeDim(0);
      for (int i = 0; i < c->num_inputs(); ++i) {
        shape_inference::ShapeHandle table;
        TF_RETURN_IF_ERROR(c->WithRank(c->input(i), 2, &table));
        TF_RETURN_IF_ERROR(c->Merge(rows, c->Dim(table, 0), &rows));
        TF_RETURN_IF_ERROR(c->Add(width, c->Dim(table, 1), &width));
      }
      c->set_output(0, c->Matrix(rows, width));
      return OkStatus();
    })
    .Doc(R"doc(
The N tables' rows side by side: row r of the output is row r of each table in turn.
)doc");

#define REGISTER(T) \
  REGISTER_KERNEL_BUILDER(Name("PicassoStackColumns").Device(DEVICE_CPU).TypeConstraint<T>("T"), StackColumnsOp<T>)
REGISTER(float);
REGISTER(double);
#undef REGISTER

}  // namespace
}  // namespace tensorflow
