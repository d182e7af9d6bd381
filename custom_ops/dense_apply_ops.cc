// PicassoDenseApply: the Keras optimizer's update of many variables with dense
// gradients in one op (a multi-tensor, "foreach" update), matching Keras 2.15.
//
// Inputs: G variables `vars` (any shapes), their optimizer slots `slots` (num_slots
// per variable, variable by variable, each shaped like its variable), their
// gradients `grads` (each shaped like its variable, or a scalar: see scaled_vars),
// R row addends (`row_indices`, `row_values`, `row_vars`: see below) and the
// update's scalar hyper-parameters `hyper`, named by hyper_names, as the
// PicassoSparseApply op of `optimizer` takes them (sparse_apply_ops.cc).
// `decayed[i]`: whether Keras' decoupled weight decay reaches variable i (its
// exclude_from_weight_decay).
//
// A gradient in parts. A looked-up table that Keras' L2 regulariser reads whole has
// for gradient AddN(UnsortedSegmentSum(values, indices, rows), Mul(table, scale)),
// TensorFlow's sum of the lookup's row gradient and the regulariser's: three
// table-sized tensors. The op takes the parts instead and makes that sum itself, bit
// for bit, a block at a time in cache:
//   scaled_vars: the variables whose `grads` entry is a scalar `scale`: their dense
//       gradient is the variable's value (before this update) times it, as Mul.
//   row addend k adds rows to the gradient of variable row_vars[k] (at most one
//       addend per variable): row_values[k] [n, ...] at rows row_indices[k] [n], each
//       row's values summed from zero in their order (a row may repeat), then added
//       to the dense gradient, as AddN(UnsortedSegmentSum(...), dense); negative
//       indices are skipped, as UnsortedSegmentSum skips them.
//
// Each element follows Keras' dense-gradient branch of update_step in Keras' float
// operation order (the Dense methods of sparse_updates.h), after the weight decay;
// the results equal Keras' except where sparse_updates.h says.
//
// Race freedom and determinism: the variables and slots are locked for the call;
// the elements of all variables are cut into blocks (whole rows for a variable with
// a row addend), each thread of TF's intra-op pool updates whole blocks, and an
// element's new value depends on that element only, so results do not depend on the
// number of threads.
#define EIGEN_USE_THREADS

#include <set>

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
    .Input("row_indices: Tindices")
    .Input("row_values: R * T")
    .Input("hyper: num_hyper * T")
    .Attr("T: {float, double}")
    .Attr("G: int >= 1")
    .Attr("decayed: list(bool)")
    .Attr("Tindices: list({int32, int64}) >= 0")
    .Attr("R: int >= 0")
    .Attr("row_vars: list(int) = []")
    .Attr("scaled_vars: list(int) = []")
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
// few large variables still spread over the pool, and that a block's gradient with
// its rows added stays in cache.
constexpr int64_t kBlock = 1 << 14;

// A row addend's positions ordered by the block their row falls in, in their order
// within each block (a stable counting sort); blocks of 2^shift whole rows.
struct RowsByBlock {
  int shift = 0;
  std::vector<int64_t> rows;        // per position, its row (negative: skipped)
  std::vector<int64_t> positions;   // the positions, block by block
  std::vector<int64_t> offsets;     // block b's positions: [offsets[b], offsets[b + 1])
};

// Elements per row of a variable with a row addend (a [V, ...] table).
inline int64_t RowSize(const Tensor& var) {
  return var.dim_size(0) == 0 ? 0 : var.NumElements() / var.dim_size(0);
}

template <typename Index>
Status SortIndices(const Tensor& indices, int64_t num_rows, RowsByBlock* out) {
  const auto flat = indices.flat<Index>();
  const int64_t n = flat.size();
  const int64_t num_blocks = ((num_rows - 1) >> out->shift) + 1;
  out->rows.resize(n);
  out->offsets.assign(num_blocks + 1, 0);
  for (int64_t p = 0; p < n; ++p) {
    const int64_t row = flat(p);
    if (row >= num_rows) {
      return errors::InvalidArgument("PicassoDenseApply: row index ", row, " at position ", p,
                                     " is out of range [0, ", num_rows, ")");
    }
    out->rows[p] = row;
    if (row >= 0) ++out->offsets[(row >> out->shift) + 1];
  }
  for (int64_t b = 0; b < num_blocks; ++b) out->offsets[b + 1] += out->offsets[b];
  std::vector<int64_t> next(out->offsets.begin(), out->offsets.end() - 1);
  out->positions.resize(out->offsets[num_blocks]);
  for (int64_t p = 0; p < n; ++p) {
    if (out->rows[p] >= 0) out->positions[next[out->rows[p] >> out->shift]++] = p;
  }
  return OkStatus();
}

// The rows of variable `var`'s addend, `indices`, by blocks of at most kBlock elements
// (one row where a row is longer), a power of two of rows (a row's block is a shift).
Status SortRows(const Tensor& var, const Tensor& indices, RowsByBlock* rows) {
  const int64_t d = std::max<int64_t>(RowSize(var), 1);
  while ((d << (rows->shift + 1)) <= kBlock) ++rows->shift;
  if (var.dim_size(0) == 0) {
    return indices.NumElements() == 0
               ? OkStatus()
               : errors::InvalidArgument("PicassoDenseApply: rows added to a variable without rows");
  }
  return indices.dtype() == DT_INT32 ? SortIndices<int32>(indices, var.dim_size(0), rows)
                                     : SortIndices<int64_t>(indices, var.dim_size(0), rows);
}

// A variable's gradient in its parts (the op's comment): its dense gradient, or the
// scale that makes it the variable times the scale; its row addend, if any.
template <typename T>
struct GradientParts {
  const T* dense = nullptr;
  bool scaled = false;               // the dense gradient is the variable times `scale`
  T scale = T(0);
  const RowsByBlock* rows = nullptr;
  const T* values = nullptr;         // the rows' values, row_size elements each
  int64_t row_size = 0;
};

// A block of work: elements [begin, end) of variable `var`; with a row addend, the
// positions [first, last) of its RowsByBlock::positions.
struct Block {
  int var;
  int64_t begin, end;
  int64_t first, last;
};

// Cuts the variables into Blocks: at any element, or at whole rows where a variable
// has a row addend.
template <typename T>
std::vector<Block> CutIntoBlocks(const std::vector<Tensor>& vars,
                                 const std::vector<GradientParts<T>>& parts) {
  std::vector<Block> blocks;
  for (int t = 0; t < static_cast<int>(parts.size()); ++t) {
    const int64_t size = vars[t].NumElements();
    const RowsByBlock* rows = parts[t].rows;
    if (rows == nullptr) {
      for (int64_t begin = 0; begin < size; begin += kBlock) {
        blocks.push_back({t, begin, std::min(begin + kBlock, size), 0, 0});
      }
      continue;
    }
    const int64_t step = RowSize(vars[t]) << rows->shift;
    for (int64_t b = 0; b + 1 < static_cast<int64_t>(rows->offsets.size()); ++b) {
      blocks.push_back({t, b * step, std::min((b + 1) * step, size), rows->offsets[b],
                        rows->offsets[b + 1]});
    }
  }
  return blocks;
}

// A block's gradient, from its parts: `var` points at the block's values (before the
// update); `scratch` holds the gradient where it is made here.
template <typename T>
const T* BlockGradient(const Block& block, const GradientParts<T>& parts, const T* var,
                       std::vector<T>* scratch) {
  const int64_t n = block.end - block.begin;
  if (parts.rows == nullptr) {
    if (!parts.scaled) return parts.dense + block.begin;
    scratch->resize(n);
    T* out = scratch->data();
    for (int64_t j = 0; j < n; ++j) out[j] = var[j] * parts.scale;
    return out;
  }
  scratch->assign(n, T(0));
  T* out = scratch->data();
  const int64_t d = parts.row_size;
  for (int64_t k = block.first; k < block.last; ++k) {
    const int64_t p = parts.rows->positions[k];
    T* row = out + (parts.rows->rows[p] * d - block.begin);
    for (int64_t j = 0; j < d; ++j) row[j] += parts.values[p * d + j];
  }
  if (parts.scaled) {
    for (int64_t j = 0; j < n; ++j) out[j] += var[j] * parts.scale;
  } else {
    const T* dense = parts.dense + block.begin;
    for (int64_t j = 0; j < n; ++j) out[j] += dense[j];
  }
  return out;
}

template <typename T>
class DenseApplyOp : public OpKernel {
 public:
  explicit DenseApplyOp(OpKernelConstruction* c) : OpKernel(c), updates_(c) {
    OP_REQUIRES_OK(c, c->GetAttr("decayed", &decayed_));
    OP_REQUIRES_OK(c, c->GetAttr("row_vars", &row_vars_));
    OP_REQUIRES_OK(c, c->GetAttr("scaled_vars", &scaled_vars_));
    int num_addends;
    OP_REQUIRES_OK(c, c->GetAttr("G", &num_vars_));
    OP_REQUIRES_OK(c, c->GetAttr("R", &num_addends));
    OP_REQUIRES(c, static_cast<int>(decayed_.size()) == num_vars_,
                errors::InvalidArgument("PicassoDenseApply: `decayed` has ", decayed_.size(),
                                        " entries for ", num_vars_, " variables"));
    OP_REQUIRES(c, static_cast<int>(row_vars_.size()) == num_addends,
                errors::InvalidArgument("PicassoDenseApply: `row_vars` has ", row_vars_.size(),
                                        " entries for ", num_addends, " row addends"));
    OP_REQUIRES_OK(c, CheckVariableList("row_vars", row_vars_));
    OP_REQUIRES_OK(c, CheckVariableList("scaled_vars", scaled_vars_));
  }

  void Compute(OpKernelContext* ctx) override {
    typename InPlaceUpdates<T>::Locked locked;
    OP_REQUIRES_OK(ctx, locked.Lock(ctx, updates_));
    const std::vector<Tensor>& vars = locked.tensors();
    std::vector<GradientParts<T>> parts(num_vars_);
    std::vector<RowsByBlock> addends(row_vars_.size());
    OP_REQUIRES_OK(ctx, GradientsInParts(ctx, vars, &parts, &addends));
    const std::vector<Block> blocks = CutIntoBlocks(vars, parts);
    auto* workers = ctx->device()->tensorflow_cpu_worker_threads()->workers;
    OP_REQUIRES_OK(ctx, locked.RunDense(ctx, [&](const auto& apply, int64_t cost) {
      workers->ParallelFor(static_cast<int64_t>(blocks.size()), cost * kBlock,
                           [&](int64_t first, int64_t last) {
        std::vector<T> scratch;
        for (int64_t b = first; b < last; ++b) {
          const Block& block = blocks[b];
          const T* grad = BlockGradient(block, parts[block.var],
                                        vars[block.var].flat<T>().data() + block.begin, &scratch);
          apply(block.var, block.begin, block.end, grad, decayed_[block.var]);
        }
      });
    }));
  }

 private:
  // The variables' gradients from the op's inputs, checked; their row addends sorted
  // into `addends`.
  Status GradientsInParts(OpKernelContext* ctx, const std::vector<Tensor>& vars,
                          std::vector<GradientParts<T>>* parts,
                          std::vector<RowsByBlock>* addends) const {
    OpInputList grads, row_indices, row_values;
    TF_RETURN_IF_ERROR(ctx->input_list("grads", &grads));
    TF_RETURN_IF_ERROR(ctx->input_list("row_indices", &row_indices));
    TF_RETURN_IF_ERROR(ctx->input_list("row_values", &row_values));
    for (int t = 0; t < num_vars_; ++t) (*parts)[t].dense = grads[t].flat<T>().data();
    for (int t : scaled_vars_) {
      if (!TensorShapeUtils::IsScalar(grads[t].shape())) {
        return errors::InvalidArgument("PicassoDenseApply: the scale of variable ", t, " (",
                                       requested_input(t), ") has shape ",
                                       grads[t].shape().DebugString());
      }
      (*parts)[t].scaled = true;
      (*parts)[t].scale = grads[t].scalar<T>()();
    }
    for (int t = 0; t < num_vars_; ++t) {
      if (!(*parts)[t].scaled && grads[t].shape() != vars[t].shape()) {
        return errors::InvalidArgument("PicassoDenseApply: the gradient of variable ", t, " (",
                                       requested_input(t), ") has shape ",
                                       grads[t].shape().DebugString(), ", the variable ",
                                       vars[t].shape().DebugString());
      }
    }
    if (row_indices.size() != row_values.size()) {
      return errors::InvalidArgument("PicassoDenseApply: ", row_indices.size(),
                                     " row indices for ", row_values.size(), " row values");
    }
    for (int k = 0; k < static_cast<int>(row_vars_.size()); ++k) {
      const Tensor& var = vars[row_vars_[k]];
      TensorShape rows_shape = var.shape();
      if (var.dims() >= 1) rows_shape.set_dim(0, row_indices[k].NumElements());
      if (var.dims() < 1 || !TensorShapeUtils::IsVector(row_indices[k].shape()) ||
          row_values[k].shape() != rows_shape) {
        return errors::InvalidArgument("PicassoDenseApply: row addend ", k, " of variable ",
                                       row_vars_[k], " (shape ", var.shape().DebugString(),
                                       ") has indices of shape ",
                                       row_indices[k].shape().DebugString(),
                                       " and values of shape ",
                                       row_values[k].shape().DebugString());
      }
    }
    std::vector<Status> sorted(row_vars_.size());
    ctx->device()->tensorflow_cpu_worker_threads()->workers->ParallelFor(
        static_cast<int64_t>(row_vars_.size()), kBlock, [&](int64_t first, int64_t last) {
          for (int64_t k = first; k < last; ++k) {
            sorted[k] = SortRows(vars[row_vars_[k]], row_indices[k], &(*addends)[k]);
          }
        });
    for (int k = 0; k < static_cast<int>(row_vars_.size()); ++k) {
      TF_RETURN_IF_ERROR(sorted[k]);
      GradientParts<T>& p = (*parts)[row_vars_[k]];
      p.rows = &(*addends)[k];
      p.values = row_values[k].flat<T>().data();
      p.row_size = RowSize(vars[row_vars_[k]]);
    }
    return OkStatus();
  }

  // `list` names distinct variables.
  Status CheckVariableList(const char* name, const std::vector<int>& list) const {
    if (std::set<int>(list.begin(), list.end()).size() != list.size()) {
      return errors::InvalidArgument("PicassoDenseApply: `", name, "` repeats a variable");
    }
    for (int var : list) {
      if (var < 0 || var >= num_vars_) {
        return errors::InvalidArgument("PicassoDenseApply: `", name, "` names variable ", var,
                                       " of ", num_vars_);
      }
    }
    return OkStatus();
  }

  InPlaceUpdates<T> updates_;
  int num_vars_;
  std::vector<bool> decayed_;
  std::vector<int> row_vars_, scaled_vars_;
};

REGISTER_KERNEL_BUILDER(Name("PicassoDenseApply").Device(DEVICE_CPU).TypeConstraint<float>("T"),
                        DenseApplyOp<float>);
REGISTER_KERNEL_BUILDER(Name("PicassoDenseApply").Device(DEVICE_CPU).TypeConstraint<double>("T"),
                        DenseApplyOp<double>);

}  // namespace
}  // namespace picasso
}  // namespace tensorflow
