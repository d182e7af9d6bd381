// Same-ids stacking's ops (picasso_tf/passes/same_ids_stacking.py): tables of the same
// rows read side by side, as the columns of one table.
//
// PicassoStackColumns: N tables side by side, as one table whose row r holds row r of
// each table in turn. One pass over the rows: TensorFlow's ConcatV2 along the columns
// copies each input's row apart, which on width-1 tables costs a call per element.
//
// PicassoStackedLookup: for sites that read their ids one by one (combiner "none"),
// what PicassoStitchedLookup gives on PicassoStackColumns' tables, read from the tables
// themselves, so no table is copied: a stack's rows at a batch's ids, not its whole rows.
#include <algorithm>
#include <atomic>
#include <vector>

#include "packed_sites.h"
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

// Rows [begin, end) of a stacked lookup's output: for each stack s and block b, the
// rows of its id in each of the stack's k tables in turn. Rows go a block at a time, stack
// by stack, so that a block's output stays in cache while the stacks' tables are read.
// False at the first id out of its stack's range (the output is then unspecified).
template <int64_t kD, typename T, typename Tid>
bool GatherStacked(const std::vector<const T*>& tables, const std::vector<const Tid*>& ids,
                   const std::vector<int64_t>& vocab, int64_t k, int64_t row_blocks, int64_t d,
                   int64_t begin, int64_t end, T* out) {
  constexpr int64_t kRowsPerBlock = 64;
  const int64_t width = kD ? kD : d;
  const int64_t stacks = static_cast<int64_t>(ids.size());
  const int64_t out_width = stacks * row_blocks * k * width;
  for (int64_t lo = begin; lo < end; lo += kRowsPerBlock) {
    const int64_t hi = std::min(end, lo + kRowsPerBlock);
    for (int64_t s = 0; s < stacks; ++s) {
      const T* const* stack = tables.data() + s * k;
      for (int64_t r = lo; r < hi; ++r) {
        T* dst = out + r * out_width + s * row_blocks * k * width;
        for (int64_t b = 0; b < row_blocks; ++b) {
          const Tid id = ids[s][r * row_blocks + b];
          if (!InRange(id, vocab[s])) return false;
          const int64_t at = static_cast<int64_t>(id) * width;
          for (int64_t t = 0; t < k; ++t, dst += width) {
            std::copy_n(stack[t] + at, width, dst);
          }
        }
      }
    }
  }
  return true;
}

template <typename T, typename Tid>
class StackedLookupOp : public OpKernel {
 public:
  explicit StackedLookupOp(OpKernelConstruction* c) : OpKernel(c) {
    int n, s;
    OP_REQUIRES_OK(c, c->GetAttr("N", &n));
    OP_REQUIRES_OK(c, c->GetAttr("S", &s));
    OP_REQUIRES_OK(c, c->GetAttr("row_blocks", &row_blocks_));
    OP_REQUIRES_OK(c, c->GetAttr("feature_names", &names_));
    OP_REQUIRES_OK(c, c->GetAttr("vocab_sizes", &vocab_));
    OP_REQUIRES(c, n % s == 0,
                errors::InvalidArgument(kOp, ": ", n, " tables for ", s, " stacks; each stack needs as many"));
    OP_REQUIRES(c, static_cast<int>(names_.size()) == s && static_cast<int>(vocab_.size()) == s,
                errors::InvalidArgument(kOp, ": feature_names and vocab_sizes need one entry per stack (", s,
                                        "); got ", names_.size(), " and ", vocab_.size()));
    k_ = n / s;
  }

  void Compute(OpKernelContext* ctx) override {
    OpInputList tables, ids;
    OP_REQUIRES_OK(ctx, ctx->input_list("tables", &tables));
    OP_REQUIRES_OK(ctx, ctx->input_list("ids", &ids));
    const int64_t stacks = ids.size();
    OP_REQUIRES(ctx, tables[0].dims() == 2,
                errors::InvalidArgument(kOp, ": table 0 has shape ", tables[0].shape().DebugString(),
                                        "; tables have 2 dimensions"));
    const int64_t d = tables[0].dim_size(1);
    std::vector<const T*> data(tables.size());
    const std::vector<int64_t>& vocab = vocab_;
    for (int64_t s = 0; s < stacks; ++s) {
      for (int64_t t = 0; t < k_; ++t) {
        const Tensor& table = tables[s * k_ + t];
        OP_REQUIRES(ctx, table.dims() == 2 && table.dim_size(0) == vocab[s] && table.dim_size(1) == d,
                    errors::InvalidArgument(kOp, ": table ", t, " of feature '", names_[s], "' has shape ",
                                            table.shape().DebugString(), "; expected [", vocab[s], ", ", d,
                                            "]: its vocabulary size and the first table's width"));
        data[s * k_ + t] = table.flat<T>().data();
      }
    }
    const int64_t n = ids[0].NumElements();
    std::vector<const Tid*> id_data(stacks);
    for (int64_t s = 0; s < stacks; ++s) {
      OP_REQUIRES(ctx, ids[s].NumElements() == n && n % row_blocks_ == 0,
                  errors::InvalidArgument(kOp, ": ids of feature '", names_[s], "' have shape ",
                                          ids[s].shape().DebugString(), "; every stack needs ", n,
                                          " ids, a multiple of row_blocks (", row_blocks_, ")"));
      id_data[s] = ids[s].flat<Tid>().data();
    }
    const int64_t rows = n / row_blocks_;
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({rows, stacks * row_blocks_ * k_ * d}), &out));
    std::atomic<bool> bad{false};
    // Per output row: each id's k table rows, a cache line each at most.
    const int64_t cost = stacks * row_blocks_ * k_ * std::min<int64_t>(64, d * sizeof(T) + 16);
    Shard(NumThreads(ctx), ctx->device()->tensorflow_cpu_worker_threads()->workers, rows, cost,
          [&](int64_t begin, int64_t end) {
      const bool ok = d == 1 ? GatherStacked<1>(data, id_data, vocab, k_, row_blocks_, d, begin, end,
                                                out->flat<T>().data())
                             : GatherStacked<0>(data, id_data, vocab, k_, row_blocks_, d, begin, end,
                                                out->flat<T>().data());
      if (!ok) bad = true;
    });
    if (!bad) return;
    for (int64_t s = 0; s < stacks; ++s) {
      for (int64_t j = 0; j < n; ++j) {
        OP_REQUIRES(ctx, InRange(id_data[s][j], vocab[s]),
                    errors::InvalidArgument(kOp, ": ids of feature '", names_[s], "' must lie in [0, ", vocab[s],
                                            "): got ", static_cast<int64_t>(id_data[s][j]), " at position ", j,
                                            "; raise the feature's vocabulary size or hash its ids into that "
                                            "range"));
      }
    }
  }

 private:
  static constexpr const char* kOp = "PicassoStackedLookup";
  int64_t k_ = 1, row_blocks_ = 1;
  std::vector<std::string> names_;
  std::vector<int64_t> vocab_;
};

REGISTER_OP("PicassoStackedLookup")
    .Input("tables: N * T")
    .Input("ids: S * Tid")
    .Output("output: T")
    .Attr("N: int >= 1")
    .Attr("S: int >= 1")
    .Attr("T: {float, double}")
    .Attr("Tid: {int32, int64}")
    .Attr("row_blocks: int >= 1")
    .Attr("vocab_sizes: list(int)")
    .Attr("feature_names: list(string)")
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      int n, s, row_blocks;
      TF_RETURN_IF_ERROR(c->GetAttr("N", &n));
      TF_RETURN_IF_ERROR(c->GetAttr("S", &s));
      TF_RETURN_IF_ERROR(c->GetAttr("row_blocks", &row_blocks));
      shape_inference::ShapeHandle table;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 2, &table));
      shape_inference::DimensionHandle width;
      TF_RETURN_IF_ERROR(c->Multiply(c->Dim(table, 1), static_cast<int64_t>(n) * row_blocks, &width));
      // Rows: the ids' first dimension where the rest holds row_blocks ids.
      shape_inference::DimensionHandle rows = c->UnknownDim();
      shape_inference::ShapeHandle ids = c->input(n);
      if (c->RankKnown(ids) && c->Rank(ids) >= 1) {
        int64_t per_row = 1;
        for (int i = 1; i < c->Rank(ids) && per_row >= 0; ++i) {
          per_row = c->ValueKnown(c->Dim(ids, i)) ? per_row * c->Value(c->Dim(ids, i)) : -1;
        }
        if (per_row == row_blocks) rows = c->Dim(ids, 0);
      }
      c->set_output(0, c->Matrix(rows, width));
      return OkStatus();
    })
    .Doc(R"doc(
The stitched lookup of S stacks of k tables (tables[s*k, (s+1)*k)) at ids[s], each
read one by one, row_blocks ids per output row: output row r holds, for each stack and
block in turn, the id's row of each of the stack's tables in turn. A stack's ids must
lie in [0, vocab_sizes[s]), its tables' rows.
)doc");

#define REGISTER(T, Tid)                                                                          \
  REGISTER_KERNEL_BUILDER(                                                                        \
      Name("PicassoStackedLookup").Device(DEVICE_CPU).TypeConstraint<T>("T").TypeConstraint<Tid>("Tid"), \
      StackedLookupOp<T, Tid>)
REGISTER(float, int32);
REGISTER(float, int64_t);
REGISTER(double, int32);
REGISTER(double, int64_t);
#undef REGISTER

}  // namespace
}  // namespace tensorflow
