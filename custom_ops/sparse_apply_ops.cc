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
// Float operation order: every expression follows keras/src/optimizers/*.py term
// by term (e.g. Adam's `m -= m * (1 - beta_1); m += g * (1 - beta_1)`, not
// `m = beta_1 * m + ...`), and the caller passes the constants Keras rounds from
// Python floats (`1 - beta_1`, computed in float64 then cast) as inputs. The results
// therefore equal Keras' (eager, CPU) bit for bit except in these places, where
// they may differ in the last bit:
//   - RMSprop's rsqrt is 1 / sqrt(x); TF's vectorised Eigen rsqrt is not always
//     correctly rounded.
//   - FTRL's accum^(-lr_power) and g^2 are correctly rounded here (sqrt for
//     lr_power = -0.5, else pow in double; g * g); TF's Eigen pow is not always.
//     FTRL's `(p(new_accum) - p(accum)) / lr * var` amplifies such a last-bit
//     difference by about var / lr.
//   - the sign of a zero, where Keras adds a +0 (a gradient of zero) to -0.
// Floating-point contraction is disabled so that -march=native does not fuse
// a * b + c into FMAs (TF's element-wise kernels round each operation).
//
// Speed: the row loops are plain loops for the compiler to vectorise. GCC
// vectorises those with a square root (Adagrad, Adam, RMSprop) only under
// -fno-math-errno, which must come from the command line (a #pragma cannot turn
// errno handling off); it changes no result.
#pragma GCC optimize("fp-contract=off")
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

namespace tensorflow {
namespace picasso {
namespace {

using CPUDevice = Eigen::ThreadPoolDevice;
using shape_inference::InferenceContext;
using shape_inference::ShapeHandle;

constexpr int kMaxSlots = 3;

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
    .SetIsStateful()
    .SetShapeFn(SparseApplyShape);

// ---------------------------------------------------------------------------
// Per-call inputs of an update.

// Reads scalar inputs by name; remembers the first problem instead of failing
// in a constructor.
template <typename T>
class ScalarInputs {
 public:
  explicit ScalarInputs(OpKernelContext* ctx) : ctx_(ctx) {}

  T operator()(const char* name) {
    const Tensor* t = nullptr;
    Status s = ctx_->input(name, &t);
    if (s.ok() && !TensorShapeUtils::IsScalar(t->shape())) {
      s = errors::InvalidArgument("`", name, "` must be a scalar, got shape ",
                                  t->shape().DebugString());
    }
    if (!s.ok()) {
      Check(false, s);
      return T(0);
    }
    return t->scalar<T>()();
  }

  void Check(bool ok, const Status& problem) {
    if (!ok && status_.ok()) status_ = problem;
  }

  const Status& status() const { return status_; }

 private:
  OpKernelContext* ctx_;
  Status status_;
};

Status CheckSlotCount(OpKernelConstruction* c, int expected, const char* what) {
  int num_slots;
  TF_RETURN_IF_ERROR(c->GetAttr("num_slots", &num_slots));
  if (num_slots != expected) {
    return errors::InvalidArgument(c->def().op(), " takes ", expected,
                                   " slot variables (", what, "), got ", num_slots);
  }
  return OkStatus();
}

// ---------------------------------------------------------------------------
// Optimizer updates. Each has
//   Attrs                   the op's attributes, read once when the kernel is built;
//   Update(attrs, scalars)  the hyper-parameters of one call;
//   changes_untouched_rows  whether Keras' update changes rows without a gradient;
//   Row<kTouched>(var, slots, grad, d)  one row of d elements (grad: null when
//                           !kTouched).

// SGD (keras/src/optimizers/sgd.py, IndexedSlices branch); slots: [] or [m].
//   plain:     var += -g * lr                                (rows with a gradient)
//   momentum:  m = m * momentum;  m += -g * lr
//              var += m                      or, nesterov:
//              var += -g * lr;  var += m * momentum
// The momentum decay and `var += m` reach every row in Keras.
template <typename T>
class SgdUpdate {
 public:
  struct Attrs {
    explicit Attrs(OpKernelConstruction* c) {
      OP_REQUIRES_OK(c, c->GetAttr("nesterov", &nesterov));
      int num_slots;
      OP_REQUIRES_OK(c, c->GetAttr("num_slots", &num_slots));
      OP_REQUIRES(c, num_slots <= 1,
                  errors::InvalidArgument("PicassoSparseApplySgd takes 0 slots (plain "
                                          "SGD) or 1 (momentum), got ", num_slots));
      has_momentum = num_slots == 1;
    }
    bool nesterov = false;
    bool has_momentum = false;
  };
  static constexpr int64_t kCostPerElement = 4;

  SgdUpdate(const Attrs& attrs, ScalarInputs<T>& in)
      : has_momentum_(attrs.has_momentum),
        nesterov_(attrs.nesterov),
        lr_(in("lr")),
        momentum_(in("momentum")) {
    in.Check(has_momentum_ || momentum_ == T(0),
             errors::InvalidArgument("momentum = ", momentum_,
                                     " needs a momentum slot variable"));
  }

  bool changes_untouched_rows() const { return has_momentum_; }

  template <bool kTouched>
  void Row(T* var, T* const* slots, const T* g, int64_t d) const {
    if (!has_momentum_) {
      if constexpr (kTouched) {
        for (int64_t j = 0; j < d; ++j) var[j] += -g[j] * lr_;
      }
      return;
    }
    T* m = slots[0];
    for (int64_t j = 0; j < d; ++j) {
      m[j] = m[j] * momentum_;
      if constexpr (kTouched) m[j] += -g[j] * lr_;
      if (nesterov_) {
        if constexpr (kTouched) var[j] += -g[j] * lr_;
        var[j] += m[j] * momentum_;
      } else {
        var[j] += m[j];
      }
    }
  }

 private:
  bool has_momentum_, nesterov_;
  T lr_, momentum_;
};

// Adagrad (adagrad.py, IndexedSlices branch); slots: [accumulator].
//   accumulator += g * g;  var += -lr * g / sqrt(accumulator + epsilon)
// Rows without a gradient are left alone.
template <typename T>
class AdagradUpdate {
 public:
  struct Attrs {
    explicit Attrs(OpKernelConstruction* c) {
      OP_REQUIRES_OK(c, CheckSlotCount(c, 1, "accumulator"));
    }
  };
  static constexpr int64_t kCostPerElement = 20;

  AdagradUpdate(const Attrs&, ScalarInputs<T>& in)
      : neg_lr_(-in("lr")), epsilon_(in("epsilon")) {}

  bool changes_untouched_rows() const { return false; }

  template <bool kTouched>
  void Row(T* var, T* const* slots, const T* g, int64_t d) const {
    if constexpr (kTouched) {
      T* accumulator = slots[0];
      for (int64_t j = 0; j < d; ++j) {
        accumulator[j] += g[j] * g[j];
        var[j] += neg_lr_ * g[j] / std::sqrt(accumulator[j] + epsilon_);
      }
    }
  }

 private:
  T neg_lr_, epsilon_;
};

// FTRL (ftrl.py). Keras has no IndexedSlices branch: it densifies the gradient,
// so every row is recomputed with g = 0 where it has none (and a row whose
// `linear` is still 0 becomes 0). Slots: [accumulator, linear].
//   shrunk = g + 2 * l2_shrinkage * var
//   new_accum = accum + g^2;  p(x) = x^(-lr_power)
//   linear += shrunk - (p(new_accum) - p(accum)) / lr * var
//   quadratic = p(new_accum) / lr + 2 * (l2 + beta / (2 * lr))
//   var = (clip(linear, -l1, l1) - linear) / quadratic;  accum = new_accum
template <typename T>
class FtrlUpdate {
 public:
  struct Attrs {
    explicit Attrs(OpKernelConstruction* c) {
      OP_REQUIRES_OK(c, CheckSlotCount(c, 2, "accumulator, linear"));
    }
  };
  static constexpr int64_t kCostPerElement = 60;

  FtrlUpdate(const Attrs&, ScalarInputs<T>& in)
      : lr_(in("lr")),
        neg_lr_power_(-in("lr_power")),
        l1_(in("l1")),
        two_l2_shrinkage_(T(2) * in("l2_shrinkage")),
        two_l2_reg_(T(2) * (in("l2") + in("beta") / (T(2) * lr_))) {}

  bool changes_untouched_rows() const { return true; }

  template <bool kTouched>
  void Row(T* var, T* const* slots, const T* g, int64_t d) const {
    T* accum = slots[0];
    T* linear = slots[1];
    for (int64_t j = 0; j < d; ++j) {
      const T grad = kTouched ? g[j] : T(0);
      const T shrunk = grad + two_l2_shrinkage_ * var[j];
      const T new_accum = accum[j] + grad * grad;
      const T old_power = AccumPower(accum[j]);
      const T new_power = kTouched ? AccumPower(new_accum) : old_power;
      linear[j] += shrunk - (new_power - old_power) / lr_ * var[j];
      const T quadratic = new_power / lr_ + two_l2_reg_;
      const T clipped = std::max(std::min(linear[j], l1_), -l1_);
      var[j] = (clipped - linear[j]) / quadratic;
      accum[j] = new_accum;
    }
  }

 private:
  // Correctly rounded (also a float's: pow in double, then rounded once).
  T AccumPower(T x) const {
    if (neg_lr_power_ == T(0.5)) return std::sqrt(x);
    return static_cast<T>(std::pow(static_cast<double>(x), static_cast<double>(neg_lr_power_)));
  }

  // Declaration order matters: two_l2_reg_ is computed from lr_.
  T lr_, neg_lr_power_, l1_, two_l2_shrinkage_, two_l2_reg_;
};

// Adam / AdamW (adam.py, adamw.py, IndexedSlices branch); slots: [m, v(, vhat)].
//   alpha = lr * sqrt(1 - beta2_power) / (1 - beta1_power)
//   m -= m * (1 - beta1);  m += g * (1 - beta1)
//   v -= v * (1 - beta2);  v += g * g * (1 - beta2)
//   amsgrad: vhat = max(vhat, v), and vhat replaces v below
//   var -= m * alpha / (sqrt(v) + epsilon)
// The decay and the var step reach every row in Keras.
template <typename T>
class AdamUpdate {
 public:
  struct Attrs {
    explicit Attrs(OpKernelConstruction* c) {
      OP_REQUIRES_OK(c, c->GetAttr("amsgrad", &amsgrad));
      OP_REQUIRES_OK(c, amsgrad ? CheckSlotCount(c, 3, "m, v, vhat")
                                : CheckSlotCount(c, 2, "m, v"));
    }
    bool amsgrad = false;
  };
  static constexpr int64_t kCostPerElement = 30;

  AdamUpdate(const Attrs& attrs, ScalarInputs<T>& in)
      : amsgrad_(attrs.amsgrad),
        alpha_(in("lr") * std::sqrt(T(1) - in("beta2_power")) /
               (T(1) - in("beta1_power"))),
        one_minus_beta1_(in("one_minus_beta1")),
        one_minus_beta2_(in("one_minus_beta2")),
        epsilon_(in("epsilon")) {}

  bool changes_untouched_rows() const { return true; }

  template <bool kTouched>
  void Row(T* var, T* const* slots, const T* g, int64_t d) const {
    T* m = slots[0];
    T* v = slots[1];
    T* vhat = amsgrad_ ? slots[2] : nullptr;
    for (int64_t j = 0; j < d; ++j) {
      m[j] -= m[j] * one_minus_beta1_;
      v[j] -= v[j] * one_minus_beta2_;
      if constexpr (kTouched) {
        m[j] += g[j] * one_minus_beta1_;
        v[j] += g[j] * g[j] * one_minus_beta2_;
      }
      T second_moment = v[j];
      if (vhat) second_moment = vhat[j] = std::max(vhat[j], v[j]);
      var[j] -= m[j] * alpha_ / (std::sqrt(second_moment) + epsilon_);
    }
  }

 private:
  bool amsgrad_;
  T alpha_, one_minus_beta1_, one_minus_beta2_, epsilon_;
};

// RMSprop (rmsprop.py, IndexedSlices branch); slots: [velocity], then
// average_gradient if centered, then momentum if given.
//   velocity = rho * velocity;  velocity += g * g * (1 - rho)
//   centered: average = rho * average;  average += g * (1 - rho)
//   denominator = velocity (- average * average) + epsilon
//   increment = lr * g * rsqrt(denominator)                (rows with a gradient)
//   momentum:  mom = momentum * mom;  mom += increment;  var += -mom
//   otherwise: var += -increment
// The decays (and `var += -mom`) reach every row in Keras.
template <typename T>
class RmspropUpdate {
 public:
  struct Attrs {
    explicit Attrs(OpKernelConstruction* c) {
      OP_REQUIRES_OK(c, c->GetAttr("centered", &centered));
      int num_slots;
      OP_REQUIRES_OK(c, c->GetAttr("num_slots", &num_slots));
      const int needed = centered ? 2 : 1;
      OP_REQUIRES(c, num_slots == needed || num_slots == needed + 1,
                  errors::InvalidArgument(
                      "PicassoSparseApplyRmsprop takes slots velocity",
                      centered ? ", average_gradient" : "",
                      " and optionally momentum, got ", num_slots, " slots"));
      has_momentum = num_slots == needed + 1;
    }
    bool centered = false;
    bool has_momentum = false;
  };
  static constexpr int64_t kCostPerElement = 30;

  RmspropUpdate(const Attrs& attrs, ScalarInputs<T>& in)
      : centered_(attrs.centered),
        has_momentum_(attrs.has_momentum),
        lr_(in("lr")),
        rho_(in("rho")),
        one_minus_rho_(in("one_minus_rho")),
        momentum_(in("momentum")),
        epsilon_(in("epsilon")) {
    in.Check(has_momentum_ || momentum_ == T(0),
             errors::InvalidArgument("momentum = ", momentum_,
                                     " needs a momentum slot variable"));
  }

  bool changes_untouched_rows() const { return true; }

  template <bool kTouched>
  void Row(T* var, T* const* slots, const T* g, int64_t d) const {
    T* velocity = slots[0];
    T* average = centered_ ? slots[1] : nullptr;
    T* mom = has_momentum_ ? slots[centered_ ? 2 : 1] : nullptr;
    for (int64_t j = 0; j < d; ++j) {
      velocity[j] = rho_ * velocity[j];
      if constexpr (kTouched) velocity[j] += g[j] * g[j] * one_minus_rho_;
      if (average) {
        average[j] = rho_ * average[j];
        if constexpr (kTouched) average[j] += g[j] * one_minus_rho_;
      }
      T increment = T(0);
      if constexpr (kTouched) {
        const T denominator = average
                                  ? velocity[j] - average[j] * average[j] + epsilon_
                                  : velocity[j] + epsilon_;
        increment = lr_ * g[j] * (T(1) / std::sqrt(denominator));
      }
      if (mom) {
        mom[j] = momentum_ * mom[j];
        if constexpr (kTouched) mom[j] += increment;
        var[j] += -mom[j];
      } else if constexpr (kTouched) {
        var[j] += -increment;
      }
    }
  }

 private:
  bool centered_, has_momentum_;
  T lr_, rho_, one_minus_rho_, momentum_, epsilon_;
};

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

// The table and its slots, looked up and locked exclusively in address order
// (the order TF's own training ops use), then made safe to write in place.
class LockedVariables {
 public:
  Status Lock(OpKernelContext* ctx, const std::vector<int>& inputs, DataType dtype) {
    for (int input : inputs) {
      core::RefCountPtr<Var> var;
      TF_RETURN_IF_ERROR(LookupResource(ctx, HandleFromInput(ctx, input), &var));
      for (const auto& other : vars_) {
        if (other.get() == var.get()) {
          return errors::InvalidArgument("the table and its slots must be distinct "
                                         "variables; input ", input, " repeats one");
        }
      }
      vars_.push_back(std::move(var));
    }
    std::vector<Var*> order;
    for (const auto& var : vars_) order.push_back(var.get());
    std::sort(order.begin(), order.end(),
              [](Var* a, Var* b) { return a->mu() < b->mu(); });
    for (Var* var : order) locks_.push_back(std::make_unique<mutex_lock>(*var->mu()));

    for (size_t k = 0; k < vars_.size(); ++k) {
      Var* var = vars_[k].get();
      if (!var->is_initialized) {
        return errors::FailedPrecondition("variable ", ctx->op_kernel().requested_input(inputs[k]),
                                          " is not initialized");
      }
      if (var->tensor()->dtype() != dtype) {
        return errors::InvalidArgument("variable ", ctx->op_kernel().requested_input(inputs[k]),
                                       " has dtype ", DataTypeString(var->tensor()->dtype()),
                                       ", expected ", DataTypeString(dtype));
      }
    }
    return OkStatus();
  }

  // Call after Lock(); `T` is the variables' dtype. Copy-on-write: a buffer still
  // shared with a pending read (a ReadVariableOp's output aliases it) is copied
  // first, so that the read keeps the old values. The variable's mode is left as
  // it is: switching it to copy-on-read, as TF's sparse training ops do, would make
  // every later dense read (e.g. the table read feeding a packed lookup) copy the
  // whole table. In copy-on-read mode nothing aliases the buffer.
  template <typename T>
  Status Tensors(OpKernelContext* ctx, std::vector<Tensor>* out) {
    for (const auto& var : vars_) {
      TF_RETURN_IF_ERROR(PrepareToUpdateVariable<CPUDevice, T>(ctx, var->tensor(),
                                                               /*copy_on_read_mode=*/false));
      out->push_back(*var->tensor());
    }
    return OkStatus();
  }

 private:
  std::vector<core::RefCountPtr<Var>> vars_;
  std::vector<std::unique_ptr<mutex_lock>> locks_;  // released before vars_
};

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
  }

  void Compute(OpKernelContext* ctx) override {
    int first_slot, end_slot;
    OP_REQUIRES_OK(ctx, InputRange("slots", &first_slot, &end_slot));
    std::vector<int> var_inputs = {0};
    for (int i = first_slot; i < end_slot; ++i) var_inputs.push_back(i);

    LockedVariables locked;
    OP_REQUIRES_OK(ctx, locked.Lock(ctx, var_inputs, DataTypeToEnum<T>::v()));
    std::vector<Tensor> vars;
    OP_REQUIRES_OK(ctx, locked.Tensors<T>(ctx, &vars));
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

    // Decoupled weight decay (Keras' _apply_weight_decay: var -= var * wd * lr),
    // then the optimizer's step, on one row.
    auto update_row = [&](int64_t row, const T* g) {
      T* w = table + row * d;
      T* slots[kMaxSlots] = {};
      for (int k = 0; k < num_slots; ++k) slots[k] = slot_tables[k] + row * d;
      if (decay) {
        for (int64_t j = 0; j < d; ++j) w[j] -= w[j] * weight_decay * lr;
      }
      if (g != nullptr) {
        update.template Row<true>(w, slots, g, d);
      } else {
        update.template Row<false>(w, slots, nullptr, d);
      }
    };

    auto* workers = ctx->device()->tensorflow_cpu_worker_threads()->workers;
    const int64_t cost = d * Update<T>::kCostPerElement;
    if (all_rows) {
      workers->ParallelFor(num_rows, cost, [&](int64_t begin, int64_t end) {
        for (int64_t row = begin; row < end; ++row) {
          update_row(row, row_map[row] >= 0 ? grads + row_map[row] * d : nullptr);
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
          update_row(index[i], grads + i * d);
        }
      });
    }
  }

 private:
  const typename Update<T>::Attrs attrs_;
  bool lazy_ = false;
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
