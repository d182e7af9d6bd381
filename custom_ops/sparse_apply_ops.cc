// Fused row-sparse optimizer updates for embedding tables, matching Keras 2.15.
//
// Each op updates a table `var` [N, ...] and its optimizer slots (same shape) in
// place from `indices` [U] (UNIQUE rows of the table) and `grad` [U, ...]. The
// hyper-parameters are scalar tensors of the table's dtype, so that a learning-rate
// schedule can feed them every step.
//
// Two forms, chosen by the `lazy` attribute:
//   exact (lazy=false): Keras' own semantics for a tf.IndexedSlices gradient.
//       Where Keras changes rows that have no gradient (SGD momentum, Adam's and
//       RMSprop's moment decay, FTRL's dense recomputation, decoupled weight decay),
//       every row of the table is updated, rows without a gradient as Keras does.
//   lazy (lazy=true): the same per-row update on the U rows with a gradient only;
//       all other rows and their slots keep their values.
// Both forms call one per-row function, `Update::Row<kTouched>`: the lazy form on
// the rows of `indices`, the exact form on every row (kTouched=false where a row
// has no gradient).
//
// Race freedom and determinism: the indices are checked (in range, no repeats)
// before anything is written. Then each thread of TF's intra-op pool owns a
// disjoint set of rows (a range of table rows in the exact form, a range of the
// unique indices in the lazy form) and a row's new value depends on that row only,
// so results are bit-identical between runs and for any number of threads.
//
// The per-row math (Keras' float operation order) is in sparse_updates.h.
#define EIGEN_USE_THREADS

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <memory>
#include <unordered_map>
#include <vector>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/resource_var.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/kernels/training_op_helpers.h"
#include "sparse_updates.h"

namespace tensorflow {
namespace picasso {
namespace {

using shape_inference::InferenceContext;
using shape_inference::ShapeHandle;

// ---------------------------------------------------------------------------
// Op registrations. Inputs: var, slots..., indices, grad, then scalars of type T.

Status SparseApplyShape(InferenceContext* c) {
  std::vector<ShapeHandle> indices, grad;
  TF_RETURN_IF_ERROR(c->input("indices", &indices));
  TF_RETURN_IF_ERROR(c->input("grad", &grad));
  ShapeHandle unused;
  TF_RETURN_IF_ERROR(c->WithRank(indices[0], 1, &unused));
  TF_RETURN_IF_ERROR(c->WithRankAtLeast(grad[0], 1, &unused));
  TF_RETURN_IF_ERROR(c->Merge(c->Vector(c->Dim(indices[0], 0)),
                              c->Vector(c->Dim(grad[0], 0)), &unused));
  int num_slots;
  TF_RETURN_IF_ERROR(c->GetAttr("num_slots", &num_slots));
  for (int i = num_slots + 3; i < c->num_inputs(); ++i) {  // the hyper-parameters
    TF_RETURN_IF_ERROR(c->WithRank(c->input(i), 0, &unused));
  }
  return OkStatus();
}

REGISTER_OP("PicassoSparseApplySgd")
    .Input("var: resource")
    .Input("slots: num_slots * resource")  // [] or [momentum]
    .Input("indices: int64")
    .Input("grad: T")
    .Input("lr: T")
    .Input("momentum: T")
    .Input("weight_decay: T")
    .Attr("T: {float, double}")
    .Attr("num_slots: int >= 0")
    .Attr("nesterov: bool = false")
    .Attr("lazy: bool = false")
    .Attr("huge_pages: bool = false")  // huge_pages.h
    .SetIsStateful()
    .SetShapeFn(SparseApplyShape);

REGISTER_OP("PicassoSparseApplyAdagrad")
    .Input("var: resource")
    .Input("slots: num_slots * resource")  // [accumulator]
    .Input("indices: int64")
    .Input("grad: T")
    .Input("lr: T")
    .Input("epsilon: T")
    .Input("weight_decay: T")
    .Attr("T: {float, double}")
    .Attr("num_slots: int >= 0")
    .Attr("lazy: bool = false")
    .Attr("huge_pages: bool = false")  // huge_pages.h
    .SetIsStateful()
    .SetShapeFn(SparseApplyShape);

REGISTER_OP("PicassoSparseApplyFtrl")
    .Input("var: resource")
    .Input("slots: num_slots * resource")  // [accumulator, linear]
    .Input("indices: int64")
    .Input("grad: T")
    .Input("lr: T")
    .Input("lr_power: T")
    .Input("l1: T")
    .Input("l2: T")
    .Input("l2_shrinkage: T")
    .Input("beta: T")
    .Input("weight_decay: T")
    .Attr("T: {float, double}")
    .Attr("num_slots: int >= 0")
    .Attr("lazy: bool = false")
    .Attr("huge_pages: bool = false")  // huge_pages.h
    .SetIsStateful()
    .SetShapeFn(SparseApplyShape);

REGISTER_OP("PicassoSparseApplyAdam")
    .Input("var: resource")
    .Input("slots: num_slots * resource")  // [m, v] or [m, v, vhat]
    .Input("indices: int64")
    .Input("grad: T")
    .Input("lr: T")
    .Input("beta1_power: T")
    .Input("beta2_power: T")
    .Input("one_minus_beta1: T")
    .Input("one_minus_beta2: T")
    .Input("epsilon: T")
    .Input("weight_decay: T")
    .Attr("T: {float, double}")
    .Attr("num_slots: int >= 0")
    .Attr("amsgrad: bool = false")
    .Attr("lazy: bool = false")
    .Attr("huge_pages: bool = false")  // huge_pages.h
    .SetIsStateful()
    .SetShapeFn(SparseApplyShape);

REGISTER_OP("PicassoSparseApplyRmsprop")
    .Input("var: resource")
    // [velocity], then average_gradient if centered, then momentum if used.
    .Input("slots: num_slots * resource")
    .Input("indices: int64")
    .Input("grad: T")
    .Input("lr: T")
    .Input("rho: T")
    .Input("one_minus_rho: T")
    .Input("momentum: T")
    .Input("epsilon: T")
    .Input("weight_decay: T")
    .Attr("T: {float, double}")
    .Attr("num_slots: int >= 0")
    .Attr("centered: bool = false")
    .Attr("lazy: bool = false")
    .Attr("huge_pages: bool = false")  // huge_pages.h
    .SetIsStateful()
    .SetShapeFn(SparseApplyShape);

// ---------------------------------------------------------------------------
// Index checks, before anything is written.

Status RepeatedIndexError(const int64_t* indices, int64_t n) {
  std::unordered_map<int64_t, int64_t> first;
  for (int64_t i = 0; i < n; ++i) {
    auto [it, inserted] = first.emplace(indices[i], i);
    if (!inserted) {
      return errors::InvalidArgument(
          "indices[", i, "] = ", indices[i], " repeats indices[", it->second,
          "]; the rows must be unique (sum the gradients of repeated rows first)");
    }
  }
  return errors::Internal("a repeated index was detected but not found again");
}

// Checks that every index is a row of the table and that no row repeats. When
// `row_map` ([num_rows]) is given, fills it with each row's position in
// `indices`, -1 for rows without a gradient. Strictly ascending indices (as the
// fused lookups' gradients give) are recognised in one sequential pass; any other
// order is checked with a bit (or row_map entry) per table row.
Status CheckIndices(OpKernelContext* ctx, const int64_t* indices, int64_t n,
                    int64_t num_rows, int32* row_map) {
  auto* workers = ctx->device()->tensorflow_cpu_worker_threads()->workers;
  int64_t ascending = 1;
  while (ascending < n && indices[ascending] > indices[ascending - 1]) ++ascending;
  if (ascending >= n && (n == 0 || (indices[0] >= 0 && indices[n - 1] < num_rows))) {
    if (row_map != nullptr) {
      workers->ParallelFor(num_rows, 1, [&](int64_t begin, int64_t end) {
        std::fill(row_map + begin, row_map + end, -1);
      });
      for (int64_t i = 0; i < n; ++i) row_map[indices[i]] = static_cast<int32>(i);
    }
    return OkStatus();
  }
  std::atomic<bool> out_of_range{false};
  workers->ParallelFor(n, 2, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      if (indices[i] < 0 || indices[i] >= num_rows) {
        out_of_range.store(true, std::memory_order_relaxed);
      }
    }
  });
  if (out_of_range) {
    for (int64_t i = 0; i < n; ++i) {
      if (indices[i] < 0 || indices[i] >= num_rows) {
        return errors::InvalidArgument("indices[", i, "] = ", indices[i],
                                       " is not a row of the table (0 <= index < ",
                                       num_rows, ")");
      }
    }
  }

  std::atomic<bool> repeated{false};
  if (row_map != nullptr) {
    workers->ParallelFor(num_rows, 1, [&](int64_t begin, int64_t end) {
      std::fill(row_map + begin, row_map + end, -1);
    });
    workers->ParallelFor(n, 8, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        int32 unclaimed = -1;
        if (!__atomic_compare_exchange_n(&row_map[indices[i]], &unclaimed,
                                         static_cast<int32>(i), false,
                                         __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
          repeated.store(true, std::memory_order_relaxed);
        }
      }
    });
  } else {
    Tensor bits_tensor;
    TF_RETURN_IF_ERROR(ctx->allocate_temp(DT_UINT64, TensorShape({(num_rows + 63) / 64}),
                                          &bits_tensor));
    auto bits = bits_tensor.flat<uint64>();
    std::fill(bits.data(), bits.data() + bits.size(), uint64{0});
    uint64* words = bits.data();
    workers->ParallelFor(n, 8, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const uint64 bit = uint64{1} << (indices[i] & 63);
        if (__atomic_fetch_or(&words[indices[i] >> 6], bit, __ATOMIC_RELAXED) & bit) {
          repeated.store(true, std::memory_order_relaxed);
        }
      }
    });
  }
  if (repeated) return RepeatedIndexError(indices, n);
  return OkStatus();
}

// ---------------------------------------------------------------------------
// The kernel shared by all optimizers.

Status CheckShapes(const std::vector<Tensor>& vars, const Tensor& indices,
                   const Tensor& grad) {
  const TensorShape& table = vars[0].shape();
  if (table.dims() < 1) {
    return errors::InvalidArgument("the table must have at least one dimension, got shape ",
                                   table.DebugString());
  }
  for (size_t k = 1; k < vars.size(); ++k) {
    if (vars[k].shape() != table) {
      return errors::InvalidArgument("slot ", k - 1, " has shape ",
                                     vars[k].shape().DebugString(),
                                     ", but the table has shape ", table.DebugString());
    }
  }
  if (!TensorShapeUtils::IsVector(indices.shape())) {
    return errors::InvalidArgument("indices must be a vector, got shape ",
                                   indices.shape().DebugString());
  }
  TensorShape expected = table;
  expected.set_dim(0, indices.dim_size(0));
  if (grad.shape() != expected) {
    return errors::InvalidArgument("grad has shape ", grad.shape().DebugString(), ", expected ",
                                   expected.DebugString(),
                                   " (one row per index, rows shaped like the table's)");
  }
  if (indices.dim_size(0) > std::numeric_limits<int32>::max()) {
    return errors::InvalidArgument("at most 2^31 - 1 rows per update, got ",
                                   indices.dim_size(0));
  }
  return OkStatus();
}

template <typename T, template <typename> class Update>
class SparseApplyOp : public OpKernel {
 public:
  explicit SparseApplyOp(OpKernelConstruction* c) : OpKernel(c), attrs_(c) {
    OP_REQUIRES_OK(c, c->GetAttr("lazy", &lazy_));
    OP_REQUIRES_OK(c, c->GetAttr("huge_pages", &use_huge_pages_));
  }

  void Compute(OpKernelContext* ctx) override {
    int first_slot, end_slot;
    OP_REQUIRES_OK(ctx, InputRange("slots", &first_slot, &end_slot));
    std::vector<int> var_inputs = {0};
    for (int i = first_slot; i < end_slot; ++i) var_inputs.push_back(i);

    LockedVariables locked;
    OP_REQUIRES_OK(ctx, locked.Lock(ctx, var_inputs, DataTypeToEnum<T>::v()));
    std::vector<Tensor> vars;
    OP_REQUIRES_OK(ctx, locked.Tensors<T>(ctx, use_huge_pages_ ? &huge_pages_ : nullptr, &vars));
    const Tensor& indices = ctx->input(end_slot);
    const Tensor& grad = ctx->input(end_slot + 1);
    OP_REQUIRES_OK(ctx, CheckShapes(vars, indices, grad));

    ScalarInputs<T> scalars(ctx);
    const Update<T> update(attrs_, scalars);
    const T lr = scalars("lr");
    const T weight_decay = scalars("weight_decay");
    OP_REQUIRES_OK(ctx, scalars.status());

    const int64_t num_rows = vars[0].dim_size(0);
    const int64_t d = vars[0].NumElements() / std::max<int64_t>(num_rows, 1);
    const int64_t n = indices.dim_size(0);
    const bool decay = weight_decay != T(0);
    const bool all_rows = !lazy_ && (update.changes_untouched_rows() || decay);

    Tensor row_map_tensor;
    int32* row_map = nullptr;
    if (all_rows) {
      OP_REQUIRES_OK(ctx, ctx->allocate_temp(DT_INT32, TensorShape({num_rows}),
                                             &row_map_tensor));
      row_map = row_map_tensor.flat<int32>().data();
    }
    const int64_t* index = indices.flat<int64_t>().data();
    OP_REQUIRES_OK(ctx, CheckIndices(ctx, index, n, num_rows, row_map));
    if (d == 0) return;

    T* table = vars[0].flat<T>().data();
    T* slot_tables[kMaxSlots] = {};
    for (size_t k = 1; k < vars.size(); ++k) slot_tables[k - 1] = vars[k].flat<T>().data();
    const int num_slots = static_cast<int>(vars.size()) - 1;
    const T* grads = grad.flat<T>().data();

    // Decoupled weight decay (Keras' _apply_weight_decay), then the step, on `count`
    // rows from `row`: one row with a gradient g, or a run of rows without (g null;
    // Row<false> is element-wise, so a run is one long loop for the vectoriser).
    auto update_rows = [&](int64_t row, int64_t count, const T* g) {
      T* w = table + row * d;
      T* slots[kMaxSlots] = {};
      for (int k = 0; k < num_slots; ++k) slots[k] = slot_tables[k] + row * d;
      if (g != nullptr) {
        UpdateRow<true>(update, w, slots, g, d, weight_decay, lr);
      } else {
        UpdateRow<false>(update, w, slots, g, count * d, weight_decay, lr);
      }
    };

    auto* workers = ctx->device()->tensorflow_cpu_worker_threads()->workers;
    const int64_t cost = d * Update<T>::kCostPerElement;
    if (all_rows) {
      workers->ParallelFor(num_rows, cost, [&](int64_t begin, int64_t end) {
        for (int64_t row = begin; row < end;) {
          if (row_map[row] >= 0) {
            update_rows(row, 1, grads + row_map[row] * d);
            ++row;
            continue;
          }
          int64_t run_end = row + 1;
          while (run_end < end && row_map[run_end] < 0) ++run_end;
          update_rows(row, run_end - row, nullptr);
          row = run_end;
        }
      });
    } else {
      // Rows are scattered over the table: prefetch those a few indices ahead.
      constexpr int64_t kAhead = 8;
      workers->ParallelFor(n, cost, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) {
          if (i + kAhead < end) {
            const int64_t ahead = index[i + kAhead] * d;
            for (int64_t b = 0; b < static_cast<int64_t>(d * sizeof(T)); b += 64) {
              __builtin_prefetch(reinterpret_cast<const char*>(table + ahead) + b, 1);
              for (int k = 0; k < num_slots; ++k) {
                __builtin_prefetch(reinterpret_cast<const char*>(slot_tables[k] + ahead) + b, 1);
              }
            }
          }
          update_rows(index[i], 1, grads + i * d);
        }
      });
    }
  }

 private:
  const typename Update<T>::Attrs attrs_;
  bool lazy_ = false;
  bool use_huge_pages_ = false;
  ::picasso::HugePageAdvisor huge_pages_;
};

#define PICASSO_REGISTER_SPARSE_APPLY(op, Update)                                \
  REGISTER_KERNEL_BUILDER(                                                       \
      Name(op).Device(DEVICE_CPU).TypeConstraint<float>("T"),                    \
      SparseApplyOp<float, Update>);                                             \
  REGISTER_KERNEL_BUILDER(                                                       \
      Name(op).Device(DEVICE_CPU).TypeConstraint<double>("T"),                   \
      SparseApplyOp<double, Update>)

PICASSO_REGISTER_SPARSE_APPLY("PicassoSparseApplySgd", SgdUpdate);
PICASSO_REGISTER_SPARSE_APPLY("PicassoSparseApplyAdagrad", AdagradUpdate);
PICASSO_REGISTER_SPARSE_APPLY("PicassoSparseApplyFtrl", FtrlUpdate);
PICASSO_REGISTER_SPARSE_APPLY("PicassoSparseApplyAdam", AdamUpdate);
PICASSO_REGISTER_SPARSE_APPLY("PicassoSparseApplyRmsprop", RmspropUpdate);

#undef PICASSO_REGISTER_SPARSE_APPLY

}  // namespace
}  // namespace picasso
}  // namespace tensorflow
