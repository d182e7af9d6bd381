// The per-row optimizer updates of picasso_tf's fused row-sparse kernels (Keras 2.15
// semantics), shared by the sparse apply ops (sparse_apply_ops.cc), the gradients
// that update their tables in place (InPlaceUpdates: the stitched projection's,
// stitched_projection_ops.cc, and the stitched lookup's, packed_lookup_ops.cc) and
// the multi-variable update of dense gradients (InPlaceUpdates::RunDense,
// dense_apply_ops.cc), which follows Keras' dense-gradient branches instead.
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
// Floating-point contraction is disabled (setup.py passes -ffp-contract=off) so that
// -march=native does not fuse a * b + c into FMAs (TF's element-wise kernels round
// each operation).
//
// Speed: the row loops are plain loops for the compiler to vectorise. GCC
// vectorises those with a square root (Adagrad, Adam, RMSprop) only under
// -fno-math-errno, which must come from the command line (a #pragma cannot turn
// errno handling off); it changes no result.
#ifndef PICASSO_TF_CUSTOM_OPS_SPARSE_UPDATES_H_
#define PICASSO_TF_CUSTOM_OPS_SPARSE_UPDATES_H_

#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <variant>
#include <vector>

#include "huge_pages.h"
#include "picasso_common.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/resource_var.h"
#include "tensorflow/core/kernels/training_op_helpers.h"

namespace tensorflow {
namespace picasso {

using CPUDevice = Eigen::ThreadPoolDevice;

constexpr int kMaxSlots = 3;

// ---------------------------------------------------------------------------
// Per-call inputs of an update.

// Reads scalar inputs by name; remembers the first problem instead of failing
// in a constructor.
template <typename T>
class ScalarInputs {
 public:
  // Scalars that are the op's inputs of the same name.
  explicit ScalarInputs(OpKernelContext* ctx) : ctx_(ctx) {}
  // Scalars that are the elements of the op's input list `list`, named by `names`.
  ScalarInputs(OpKernelContext* ctx, const std::vector<std::string>& names, const char* list)
      : ctx_(ctx), names_(&names), list_(list) {}

  T operator()(const char* name) {
    const Tensor* t = nullptr;
    Status s = Find(name, &t);
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
  Status Find(const char* name, const Tensor** t) {
    if (names_ == nullptr) return ctx_->input(name, t);
    OpInputList values;
    TF_RETURN_IF_ERROR(ctx_->input_list(list_, &values));
    for (size_t k = 0; k < names_->size() && k < static_cast<size_t>(values.size()); ++k) {
      if ((*names_)[k] == name) {
        *t = &values[k];
        return OkStatus();
      }
    }
    return errors::InvalidArgument("`", list_, "` has no hyper-parameter named `", name, "`");
  }

  OpKernelContext* ctx_;
  const std::vector<std::string>* names_ = nullptr;
  const char* list_ = nullptr;
  Status status_;
};

inline Status CheckSlotCount(OpKernelConstruction* c, int expected, const char* what) {
  int num_slots;
  TF_RETURN_IF_ERROR(c->GetAttr("num_slots", &num_slots));
  if (num_slots != expected) {
    return errors::InvalidArgument(c->def().op(), " takes ", expected,
                                   " slot variables (", what, "), got ", num_slots);
  }
  return OkStatus();
}

// A momentum (SGD, RMSprop) without a slot to keep it in is an error.
template <typename T>
void CheckMomentumSlot(ScalarInputs<T>& in, bool has_momentum, T momentum) {
  in.Check(has_momentum || momentum == T(0),
           errors::InvalidArgument("momentum = ", momentum, " needs a momentum slot variable"));
}

// ---------------------------------------------------------------------------
// Optimizer updates. Each has
//   Attrs                   the op's attributes, read once when the kernel is built;
//   Update(attrs, scalars)  the hyper-parameters of one call;
//   changes_untouched_rows  whether Keras' update changes rows without a gradient;
//   Row<kTouched>(var, slots, grad, d)  one row of d elements (grad: null when
//                           !kTouched). Row<false> must treat each element on its
//                           own: the exact form passes a run of rows as one row.
//   Dense(var, slots, grad, d)  d elements of a variable with a dense gradient,
//                           as Keras' dense branch (element by element: a variable
//                           may be cut anywhere).

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
    CheckMomentumSlot(in, has_momentum_, momentum_);
  }

  bool changes_untouched_rows() const { return has_momentum_; }

  template <bool kTouched>
  void Row(T* var, T* const* slots, const T* g, int64_t d) const {
    if (!has_momentum_) {
      if constexpr (kTouched) Plain(var, g, d, lr_);
    } else if (nesterov_) {
      Momentum<kTouched, true>(var, slots[0], g, d);
    } else {
      Momentum<kTouched, false>(var, slots[0], g, d);
    }
  }

  // Keras' dense branch, `m = -g * lr + m * momentum`, rounds as Row<true> (a sum
  // of the same two terms), except Nesterov's step: var += -g * lr + m * momentum.
  void Dense(T* var, T* const* slots, const T* g, int64_t d) const {
    if (has_momentum_ && nesterov_) {
      NesterovDense(var, slots[0], g, d);
    } else {
      Row<true>(var, slots, g, d);
    }
  }

 private:
  // Unaliased tables and constants in locals (see AdamUpdate::Moments).
  static void Plain(T* __restrict var, const T* __restrict g, int64_t d, T lr) {
    for (int64_t j = 0; j < d; ++j) var[j] += -g[j] * lr;
  }

  void NesterovDense(T* __restrict var, T* __restrict m, const T* __restrict g, int64_t d) const {
    const T lr = lr_, momentum = momentum_;
    for (int64_t j = 0; j < d; ++j) {
      m[j] = -g[j] * lr + m[j] * momentum;
      var[j] += -g[j] * lr + m[j] * momentum;
    }
  }

  template <bool kTouched, bool kNesterov>
  void Momentum(T* __restrict var, T* __restrict m, const T* __restrict g, int64_t d) const {
    const T lr = lr_, momentum = momentum_;
    for (int64_t j = 0; j < d; ++j) {
      m[j] = m[j] * momentum;
      if constexpr (kTouched) m[j] += -g[j] * lr;
      if constexpr (kNesterov) {
        if constexpr (kTouched) var[j] += -g[j] * lr;
        var[j] += m[j] * momentum;
      } else {
        var[j] += m[j];
      }
    }
  }

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
    if constexpr (kTouched) Accumulate(var, slots[0], g, d, neg_lr_, epsilon_);
  }

  // Keras' dense branch, `var -= lr * g / sqrt(accumulator + epsilon)`, rounds as
  // Row<true> (negation is exact).
  void Dense(T* var, T* const* slots, const T* g, int64_t d) const { Row<true>(var, slots, g, d); }

 private:
  // Unaliased tables and constants in locals (see AdamUpdate::Moments).
  static void Accumulate(T* __restrict var, T* __restrict accumulator, const T* __restrict g,
                         int64_t d, T neg_lr, T epsilon) {
    for (int64_t j = 0; j < d; ++j) {
      accumulator[j] += g[j] * g[j];
      var[j] += neg_lr * g[j] / std::sqrt(accumulator[j] + epsilon);
    }
  }

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
    if (neg_lr_power_ == T(0.5)) {
      Step<kTouched, true>(var, slots[0], slots[1], g, d);
    } else {
      Step<kTouched, false>(var, slots[0], slots[1], g, d);
    }
  }

  // Keras' only branch is the dense one.
  void Dense(T* var, T* const* slots, const T* g, int64_t d) const { Row<true>(var, slots, g, d); }

 private:
  // Unaliased tables and constants in locals (see AdamUpdate::Moments); the usual
  // lr_power = -0.5 (kSqrt) in a loop of its own, which vectorises.
  template <bool kTouched, bool kSqrt>
  void Step(T* __restrict var, T* __restrict accum, T* __restrict linear,
            const T* __restrict g, int64_t d) const {
    const T lr = lr_, neg_lr_power = neg_lr_power_, l1 = l1_,
            two_l2_shrinkage = two_l2_shrinkage_, two_l2_reg = two_l2_reg_;
    // Correctly rounded (also a float's: pow in double, then rounded once).
    auto power = [neg_lr_power](T x) {
      if constexpr (kSqrt) {
        return std::sqrt(x);
      } else {
        return static_cast<T>(std::pow(static_cast<double>(x), static_cast<double>(neg_lr_power)));
      }
    };
    for (int64_t j = 0; j < d; ++j) {
      const T grad = kTouched ? g[j] : T(0);
      const T shrunk = grad + two_l2_shrinkage * var[j];
      const T new_accum = accum[j] + grad * grad;
      const T old_power = power(accum[j]);
      const T new_power = kTouched ? power(new_accum) : old_power;
      linear[j] += shrunk - (new_power - old_power) / lr * var[j];
      const T quadratic = new_power / lr + two_l2_reg;
      const T clipped = std::max(std::min(linear[j], l1), -l1);
      var[j] = (clipped - linear[j]) / quadratic;
      accum[j] = new_accum;
    }
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
    if (amsgrad_) {
      Moments<kTouched, true>(var, slots[0], slots[1], slots[2], g, d);
    } else {
      Moments<kTouched, false>(var, slots[0], slots[1], nullptr, g, d);
    }
  }

  // Keras' dense branch: m += (g - m) * (1 - beta1);  v += (g * g - v) * (1 - beta2);
  // then as Row<true>.
  void Dense(T* var, T* const* slots, const T* g, int64_t d) const {
    if (amsgrad_) {
      DenseMoments<true>(var, slots[0], slots[1], slots[2], g, d);
    } else {
      DenseMoments<false>(var, slots[0], slots[1], nullptr, g, d);
    }
  }

 private:
  // The row loop with the tables marked unaliased (a locked table's buffer is its
  // own) and the constants in locals, so that GCC vectorises it without run-time
  // alias checks.
  template <bool kTouched, bool kAmsgrad>
  void Moments(T* __restrict var, T* __restrict m, T* __restrict v, T* __restrict vhat,
               const T* __restrict g, int64_t d) const {
    const T alpha = alpha_, c1 = one_minus_beta1_, c2 = one_minus_beta2_, eps = epsilon_;
    for (int64_t j = 0; j < d; ++j) {
      m[j] -= m[j] * c1;
      v[j] -= v[j] * c2;
      if constexpr (kTouched) {
        m[j] += g[j] * c1;
        v[j] += g[j] * g[j] * c2;
      }
      T second_moment = v[j];
      if constexpr (kAmsgrad) second_moment = vhat[j] = std::max(vhat[j], v[j]);
      var[j] -= m[j] * alpha / (std::sqrt(second_moment) + eps);
    }
  }

  template <bool kAmsgrad>
  void DenseMoments(T* __restrict var, T* __restrict m, T* __restrict v, T* __restrict vhat,
                    const T* __restrict g, int64_t d) const {
    const T alpha = alpha_, c1 = one_minus_beta1_, c2 = one_minus_beta2_, eps = epsilon_;
    for (int64_t j = 0; j < d; ++j) {
      m[j] += (g[j] - m[j]) * c1;
      v[j] += (g[j] * g[j] - v[j]) * c2;
      T second_moment = v[j];
      if constexpr (kAmsgrad) second_moment = vhat[j] = std::max(vhat[j], v[j]);
      var[j] -= m[j] * alpha / (std::sqrt(second_moment) + eps);
    }
  }

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
    CheckMomentumSlot(in, has_momentum_, momentum_);
  }

  bool changes_untouched_rows() const { return true; }

  template <bool kTouched>
  void Row(T* var, T* const* slots, const T* g, int64_t d) const {
    T* velocity = slots[0];
    T* average = centered_ ? slots[1] : nullptr;
    T* mom = has_momentum_ ? slots[centered_ ? 2 : 1] : nullptr;
    if (centered_) {
      if (has_momentum_) {
        Step<kTouched, true, true>(var, velocity, average, mom, g, d);
      } else {
        Step<kTouched, true, false>(var, velocity, average, mom, g, d);
      }
    } else if (has_momentum_) {
      Step<kTouched, false, true>(var, velocity, average, mom, g, d);
    } else {
      Step<kTouched, false, false>(var, velocity, average, mom, g, d);
    }
  }

  // Keras' dense branch, `velocity = rho * velocity + (1 - rho) * g^2` (and likewise
  // the average and momentum), rounds as Row<true>: sums of the same terms.
  void Dense(T* var, T* const* slots, const T* g, int64_t d) const { Row<true>(var, slots, g, d); }

 private:
  // Unaliased tables and constants in locals (see AdamUpdate::Moments).
  template <bool kTouched, bool kCentered, bool kMomentum>
  void Step(T* __restrict var, T* __restrict velocity, T* __restrict average,
            T* __restrict mom, const T* __restrict g, int64_t d) const {
    const T lr = lr_, rho = rho_, one_minus_rho = one_minus_rho_, momentum = momentum_,
            epsilon = epsilon_;
    for (int64_t j = 0; j < d; ++j) {
      velocity[j] = rho * velocity[j];
      if constexpr (kTouched) velocity[j] += g[j] * g[j] * one_minus_rho;
      if constexpr (kCentered) {
        average[j] = rho * average[j];
        if constexpr (kTouched) average[j] += g[j] * one_minus_rho;
      }
      T increment = T(0);
      if constexpr (kTouched) {
        const T denominator = kCentered ? velocity[j] - average[j] * average[j] + epsilon
                                        : velocity[j] + epsilon;
        increment = lr * g[j] * (T(1) / std::sqrt(denominator));
      }
      if constexpr (kMomentum) {
        mom[j] = momentum * mom[j];
        if constexpr (kTouched) mom[j] += increment;
        var[j] += -mom[j];
      } else if constexpr (kTouched) {
        var[j] += -increment;
      }
    }
  }

  bool centered_, has_momentum_;
  T lr_, rho_, one_minus_rho_, momentum_, epsilon_;
};


// Keras' decoupled weight decay, var -= var * weight_decay * lr, on d elements
// (skipped when weight_decay is 0).
template <typename T>
inline void DecayWeights(T* var, int64_t d, T weight_decay, T lr) {
  if (weight_decay != T(0)) {
    for (int64_t j = 0; j < d; ++j) var[j] -= var[j] * weight_decay * lr;
  }
}

// The weight decay, then the update's step, on one row: var and slots point at it.
template <bool kTouched, typename Update, typename T>
inline void UpdateRow(const Update& update, T* var, T* const* slots, const T* g, int64_t d,
                      T weight_decay, T lr) {
  DecayWeights(var, d, weight_decay, lr);
  update.template Row<kTouched>(var, slots, g, d);
}

// One of the updates, chosen when the kernel is built by its string attribute
// `optimizer` (sgd, adagrad, ftrl, adam or rmsprop), for ops that serve them all.
template <typename T>
class AnyUpdate {
 public:
  explicit AnyUpdate(OpKernelConstruction* c) {
    std::string name;
    OP_REQUIRES_OK(c, c->GetAttr("optimizer", &name));
    if (name == "sgd") {
      attrs_.template emplace<Chosen<SgdUpdate>>(c);
    } else if (name == "adagrad") {
      attrs_.template emplace<Chosen<AdagradUpdate>>(c);
    } else if (name == "ftrl") {
      attrs_.template emplace<Chosen<FtrlUpdate>>(c);
    } else if (name == "adam") {
      attrs_.template emplace<Chosen<AdamUpdate>>(c);
    } else if (name == "rmsprop") {
      attrs_.template emplace<Chosen<RmspropUpdate>>(c);
    } else {
      c->CtxFailure(errors::InvalidArgument("unknown optimizer `", name, "`"));
    }
  }

  // Builds this call's update from the scalars and calls fn(update) with it, the
  // update's concrete type known to fn (its rows inline, its kCostPerElement).
  template <typename Fn>
  Status With(ScalarInputs<T>& scalars, const Fn& fn) const {
    return std::visit([&](const auto& chosen) -> Status {
      if constexpr (std::is_same_v<std::decay_t<decltype(chosen)>, std::monostate>) {
        return errors::Internal("no optimizer chosen");
      } else {
        const typename std::decay_t<decltype(chosen)>::Update update(chosen.attrs, scalars);
        TF_RETURN_IF_ERROR(scalars.status());
        fn(update);
        return OkStatus();
      }
    }, attrs_);
  }

 private:
  template <template <typename> class U>
  struct Chosen {
    using Update = U<T>;
    explicit Chosen(OpKernelConstruction* c) : attrs(c) {}
    typename Update::Attrs attrs;
  };
  std::variant<std::monostate, Chosen<SgdUpdate>, Chosen<AdagradUpdate>, Chosen<FtrlUpdate>,
               Chosen<AdamUpdate>, Chosen<RmspropUpdate>>
      attrs_;
};

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
  // With an advisor, large buffers go on huge pages (huge_pages.h).
  template <typename T>
  Status Tensors(OpKernelContext* ctx, ::picasso::HugePageAdvisor* huge_pages,
                 std::vector<Tensor>* out) {
    for (const auto& var : vars_) {
      TF_RETURN_IF_ERROR(PrepareToUpdateVariable<CPUDevice, T>(ctx, var->tensor(),
                                                               /*copy_on_read_mode=*/false));
      if (huge_pages != nullptr) huge_pages->Advise(*var->tensor());
      out->push_back(*var->tensor());
    }
    return OkStatus();
  }

 private:
  std::vector<core::RefCountPtr<Var>> vars_;
  std::vector<std::unique_ptr<mutex_lock>> locks_;  // released before vars_
};

// The attributes that InPlaceUpdates reads, for the REGISTER_OP of an op that applies
// an update in place (after its inputs vars: G * resource, slots: num_table_slots *
// resource and hyper: num_hyper * T): one list, so that the ops cannot drift apart.
#define PICASSO_IN_PLACE_UPDATE_ATTRS                                    \
  .Attr("optimizer: {'sgd', 'adagrad', 'ftrl', 'adam', 'rmsprop'}")      \
      .Attr("num_slots: int >= 0")                                       \
      .Attr("num_table_slots: int >= 0")                                 \
      .Attr("num_hyper: int >= 0")                                       \
      .Attr("hyper_names: list(string)")                                 \
      .Attr("nesterov: bool = false")                                    \
      .Attr("amsgrad: bool = false")                                     \
      .Attr("centered: bool = false")                                    \
      .Attr("huge_pages: bool = false")

// The tables that a gradient kernel updates in place instead of returning their
// gradients: the op's G "vars", their optimizer slots "slots" (num_slots per table,
// table by table, in the order the PicassoSparseApply op of `optimizer` takes them)
// and that op's scalar inputs as "hyper", named by hyper_names. Run updates only
// rows with a gradient (the lazy form, which is Keras' own for Adagrad and
// momentum-free SGD); RunDense whole variables from dense gradients (any shape).
template <typename T>
class InPlaceUpdates {
 public:
  explicit InPlaceUpdates(OpKernelConstruction* c) : update_(c) {
    OP_REQUIRES_OK(c, c->GetAttr("num_slots", &num_slots_));
    OP_REQUIRES_OK(c, c->GetAttr("hyper_names", &hyper_names_));
    OP_REQUIRES_OK(c, c->GetAttr("huge_pages", &use_huge_pages_));
    int num_table_slots;
    OP_REQUIRES_OK(c, c->GetAttr("G", &num_tables_));
    OP_REQUIRES_OK(c, c->GetAttr("num_table_slots", &num_table_slots));
    OP_REQUIRES(c, num_table_slots == num_tables_ * num_slots_,
                errors::InvalidArgument(c->def().op(), ": ", num_tables_, " tables with ",
                                        num_slots_, " slots each need ", num_tables_ * num_slots_,
                                        " slot variables; got ", num_table_slots));
  }

  // One call's variables, locked (for as long as it lives) and checked.
  class Locked {
   public:
    Status Lock(OpKernelContext* ctx, const InPlaceUpdates& updates) {
      updates_ = &updates;
      int vars_begin, vars_end, slots_begin, slots_end;
      TF_RETURN_IF_ERROR(ctx->op_kernel().InputRange("vars", &vars_begin, &vars_end));
      TF_RETURN_IF_ERROR(ctx->op_kernel().InputRange("slots", &slots_begin, &slots_end));
      std::vector<int> inputs;
      for (int i = vars_begin; i < vars_end; ++i) inputs.push_back(i);
      for (int i = slots_begin; i < slots_end; ++i) inputs.push_back(i);
      TF_RETURN_IF_ERROR(locked_.Lock(ctx, inputs, DataTypeToEnum<T>::v()));
      TF_RETURN_IF_ERROR(locked_.Tensors<T>(
          ctx, updates.use_huge_pages_ ? &updates.huge_pages_ : nullptr, &vars_));
      const int num_tables = updates.num_tables_, num_slots = updates.num_slots_;
      for (int t = 0; t < num_tables; ++t) {
        for (int k = 0; k < num_slots; ++k) {
          const Tensor& slot = vars_[num_tables + t * num_slots + k];
          if (slot.shape() != vars_[t].shape()) {
            return errors::InvalidArgument(ctx->op_kernel().type_string(), ": slot ", k,
                                           " of table ", t, " has shape ",
                                           slot.shape().DebugString(), ", the table ",
                                           vars_[t].shape().DebugString());
          }
          slot_data_.push_back(vars_[num_tables + t * num_slots + k].flat<T>().data());
        }
        widths_.push_back(vars_[t].dims() == 2 ? vars_[t].dim_size(1) : 0);
      }
      return OkStatus();
    }

    // The tables' values (then their slots').
    const std::vector<Tensor>& tensors() const { return vars_; }

    // Calls fn(apply) with this call's update, where apply(t, rows, n, grads) updates
    // rows rows[0..n) of table t from their gradient rows grads [n, d]. Calls for
    // disjoint rows may run at once.
    template <typename Fn>
    Status Run(OpKernelContext* ctx, const Fn& fn) {
      return WithUpdate(ctx, [&](const auto& update, T lr, T weight_decay) {
        fn([&](int t, const int64_t* rows, int64_t n, const T* grads) {
          const int64_t d = vars_[t].dim_size(1);
          T* table = vars_[t].flat<T>().data();
          T* slot_tables[kMaxSlots] = {};
          SlotData(t, 0, slot_tables);
          // The rows are scattered over the tables: prefetch their slots' rows ahead.
          const int64_t ahead = ::picasso::PrefetchDistance(d * sizeof(T));
          const int num_slots = updates_->num_slots_;
          T* slots[kMaxSlots] = {};
          for (int64_t u = 0; u < n; ++u) {
            if (u + ahead < n) {
              ::picasso::PrefetchBytes(table + rows[u + ahead] * d, d * sizeof(T));
              for (int k = 0; k < num_slots; ++k) {
                ::picasso::PrefetchBytes(slot_tables[k] + rows[u + ahead] * d, d * sizeof(T));
              }
            }
            for (int k = 0; k < num_slots; ++k) slots[k] = slot_tables[k] + rows[u] * d;
            UpdateRow<true>(update, table + rows[u] * d, slots, grads + u * d, d, weight_decay,
                            lr);
          }
        });
      });
    }

    // Asks for row `row` of table t's slots, which apply will read.
    void PrefetchSlots(int t, int64_t row) const {
      const int num_slots = updates_->num_slots_;
      const int64_t d = widths_[t];
      for (int k = 0; k < num_slots; ++k) {
        ::picasso::PrefetchBytes(slot_data_[t * num_slots + k] + row * d, d * sizeof(T));
      }
    }

    // Calls fn(apply, cost) with this call's update, where apply(t, begin, end, grad,
    // decayed) runs Keras' dense-gradient update on elements [begin, end) of table t
    // (any shape), grad pointing at their gradients, after the weight decay where
    // `decayed`; cost: the update's cost per element. Calls for disjoint elements may
    // run at once.
    template <typename Fn>
    Status RunDense(OpKernelContext* ctx, const Fn& fn) {
      return WithUpdate(ctx, [&](const auto& update, T lr, T weight_decay) {
        auto apply = [&](int t, int64_t begin, int64_t end, const T* grad, bool decayed) {
          T* var = vars_[t].flat<T>().data() + begin;
          T* slots[kMaxSlots] = {};
          SlotData(t, begin, slots);
          if (decayed) DecayWeights(var, end - begin, weight_decay, lr);
          update.Dense(var, slots, grad, end - begin);
        };
        fn(apply, std::decay_t<decltype(update)>::kCostPerElement);
      });
    }

   private:
    // Calls fn(update, lr, weight_decay): this call's update and the scalars that the
    // weight decay takes.
    template <typename Fn>
    Status WithUpdate(OpKernelContext* ctx, const Fn& fn) {
      ScalarInputs<T> scalars(ctx, updates_->hyper_names_, "hyper");
      const T lr = scalars("lr"), weight_decay = scalars("weight_decay");
      return updates_->update_.With(
          scalars, [&](const auto& update) { fn(update, lr, weight_decay); });
    }

    // The data of table t's slots, `offset` elements in.
    void SlotData(int t, int64_t offset, T** slots) {
      const int num_tables = updates_->num_tables_, num_slots = updates_->num_slots_;
      for (int k = 0; k < num_slots; ++k) {
        slots[k] = vars_[num_tables + t * num_slots + k].flat<T>().data() + offset;
      }
    }

    const InPlaceUpdates* updates_ = nullptr;
    LockedVariables locked_;
    std::vector<Tensor> vars_;  // the tables, then table-major slots
    std::vector<const T*> slot_data_;  // the slots' data, table-major
    std::vector<int64_t> widths_;      // each table's row width (PrefetchSlots)
  };

 private:
  AnyUpdate<T> update_;
  int num_tables_ = 0, num_slots_ = 0;
  std::vector<std::string> hyper_names_;
  bool use_huge_pages_ = false;
  mutable ::picasso::HugePageAdvisor huge_pages_;
};

}  // namespace picasso
}  // namespace tensorflow

#endif  // PICASSO_TF_CUSTOM_OPS_SPARSE_UPDATES_H_