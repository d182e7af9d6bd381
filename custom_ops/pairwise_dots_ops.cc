// PicassoPairwiseDots: the pairwise dot products of a DLRM-style feature interaction,
//   output[b, p] = sum_k x[b, left[p], k] * x[b, right[p], k]      x [B, F, d]
// which models write as tf.matmul(x, x, transpose_b=True) ([B, F, F]) followed by a
// gather of some of its entries (e.g. the strictly lower triangle). Stock TF then
// spends most of that layer's time outside the arithmetic: the gather copies single
// floats, and its gradient scatters them back into a [B, F, F] tensor that two
// batched products and their transposes turn into x's gradient.
//
// Both kernels here put one sample in each lane of a vector register: a block of
// kLanes samples is transposed into [F * d][kLanes] (ToLanes, kLanes x kLanes at a
// time), so that every multiply-add does useful work for kLanes samples and no
// dot product needs a horizontal sum, whatever F and d are. The forward takes the
// pairs grouped by left feature, kDotGroup at a time, so that the left row is loaded
// once for the group; the gradient, PicassoPairwiseDotsGrad, gives feature i the sum
// of grad[b, p] * x[b, other] over the pairs p that i is in (`other` their other
// feature; the pairs are sorted by feature once, when the kernel is built). Results
// are transposed back (FromLanes). Sums run in their own order: equal to the batched
// MatMul's up to rounding.
#define EIGEN_USE_THREADS

#include <algorithm>
#include <vector>

#include "picasso_common.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"

// Eigen's PacketBlock<__m512, 16> drops the vector type's alignment attribute from the
// template argument (harmless: the packets live in registers), and GCC cannot see that
// the intrinsics' undefined upper halves in Eigen's transposes are always overwritten.
#pragma GCC diagnostic ignored "-Wignored-attributes"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

namespace tensorflow {
namespace picasso {
namespace {

using ::picasso::kLanes;
using ::picasso::Packet;
using ::picasso::RunWorkItems;
using shape_inference::InferenceContext;
using shape_inference::ShapeHandle;

constexpr char kDotsOp[] = "PicassoPairwiseDots";
constexpr char kGradOp[] = "PicassoPairwiseDotsGrad";

// Samples per work item: enough to pay for claiming it.
constexpr int64_t kSamplesPerItem = 64;
// Below this many multiply-adds, waking threads costs more than it saves.
constexpr int64_t kMinParallelWork = 1 << 18;

// x is [batch, features, dim], and every pair has both its features.
Status CheckPairs(InferenceContext* c) {
  ShapeHandle x;
  TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 3, &x));
  std::vector<int64_t> left, right;
  TF_RETURN_IF_ERROR(c->GetAttr("left", &left));
  TF_RETURN_IF_ERROR(c->GetAttr("right", &right));
  if (left.size() != right.size()) {
    return errors::InvalidArgument("left and right must have one entry per pair; got ",
                                   left.size(), " and ", right.size());
  }
  return OkStatus();
}

// The attributes both ops read through Pairs and pairs_column, listed once.
#define PICASSO_PAIRS_ATTRS                  \
  .Attr("T: {float, double}")                \
      .Attr("left: list(int) >= 0")          \
      .Attr("right: list(int) >= 0")         \
      .Attr("pairs_column: int >= 0")

REGISTER_OP("PicassoPairwiseDots")
    .Input("x: T")
    .Input("dense: M * T")
    .Output("output: T")
    PICASSO_PAIRS_ATTRS
    .Attr("M: int >= 0")
    .Attr("dense_columns: list(int)")
    .Attr("width: int >= 0")
    .SetShapeFn([](InferenceContext* c) {
      TF_RETURN_IF_ERROR(CheckPairs(c));
      int64_t width;
      TF_RETURN_IF_ERROR(c->GetAttr("width", &width));
      c->set_output(0, c->Matrix(c->Dim(c->input(0), 0), width));
      return OkStatus();
    })
    .Doc(R"doc(
For x [B, F, d], the output [B, width] holds the dot products of the feature pairs
(left[p], right[p]) of every sample in columns [pairs_column, pairs_column + P), and
dense input m ([B, w_m]) in columns [dense_columns[m], dense_columns[m] + w_m): the
concatenation a model makes of them, built without the copy. Together they fill
every column once.
)doc");

REGISTER_OP("PicassoPairwiseDotsGrad")
    .Input("x: T")
    .Input("grad: T")
    .Output("x_grad: T")
    PICASSO_PAIRS_ATTRS
    .SetShapeFn([](InferenceContext* c) {
      TF_RETURN_IF_ERROR(CheckPairs(c));
      c->set_output(0, c->input(0));
      return OkStatus();
    })
    .Doc(R"doc(
The gradient of PicassoPairwiseDots with respect to x, given the gradient of its
output [B, width]: the pairs' columns are read in place.
)doc");

// The op's pairs, checked against the features of its input.
struct Pairs {
  Status Init(OpKernelConstruction* c) {
    TF_RETURN_IF_ERROR(c->GetAttr("left", &left));
    TF_RETURN_IF_ERROR(c->GetAttr("right", &right));
    if (left.size() != right.size()) {
      return errors::InvalidArgument(c->def().op(), ": left and right need one entry per pair; got ",
                                     left.size(), " and ", right.size());
    }
    int64_t features = 0;
    for (size_t p = 0; p < left.size(); ++p) {
      if (left[p] < 0 || right[p] < 0) {
        return errors::InvalidArgument(c->def().op(), ": pair ", p, " is (", left[p], ", ",
                                       right[p], "); features are numbered from 0");
      }
      features = std::max({features, left[p] + 1, right[p] + 1});
    }
    // Counting sort of the pairs' two ends by feature.
    partners_begin.assign(features + 1, 0);
    for (size_t p = 0; p < left.size(); ++p) {
      ++partners_begin[left[p] + 1];
      ++partners_begin[right[p] + 1];
    }
    for (int64_t i = 0; i < features; ++i) partners_begin[i + 1] += partners_begin[i];
    partners.resize(2 * left.size());
    std::vector<int64_t> next(partners_begin.begin(), partners_begin.end() - 1);
    for (size_t p = 0; p < left.size(); ++p) {
      partners[next[left[p]]++] = {static_cast<int64_t>(p), right[p]};
      partners[next[right[p]]++] = {static_cast<int64_t>(p), left[p]};
    }
    return OkStatus();
  }

  // The (pair, other feature) entries of feature i, as [begin, end) into partners.
  int64_t PartnersBegin(int64_t i) const {
    return i < static_cast<int64_t>(partners_begin.size()) ? partners_begin[i] : partners.size();
  }
  int64_t PartnersEnd(int64_t i) const {
    return i + 1 < static_cast<int64_t>(partners_begin.size()) ? partners_begin[i + 1]
                                                                : partners.size();
  }

  Status Check(const char* op, const Tensor& x) const {
    if (x.dims() != 3) {
      return errors::InvalidArgument(op, ": x must be [batch, features, dim]; got shape ",
                                     x.shape().DebugString());
    }
    const int64_t features = x.dim_size(1);
    for (size_t p = 0; p < left.size(); ++p) {
      if (left[p] < 0 || left[p] >= features || right[p] < 0 || right[p] >= features) {
        return errors::InvalidArgument(op, ": pair ", p, " is (", left[p], ", ", right[p],
                                       "), outside the ", features, " features of x ",
                                       x.shape().DebugString());
      }
    }
    return OkStatus();
  }

  int64_t size() const { return static_cast<int64_t>(left.size()); }

  std::vector<int64_t> left, right;
  // Per feature, the pairs it is in with the other feature of each (a pair of a
  // feature with itself is there twice): x's gradient row i is the sum of
  // grad[p] * x[other] over feature i's entries.
  std::vector<int64_t> partners_begin;
  std::vector<std::pair<int64_t, int64_t>> partners;
};

// A work item's scratch: aligned, so that every packet of it is, and left uninitialised
// (each kernel writes every value it reads).
template <typename T>
struct LaneBuffer {
  explicit LaneBuffer(int64_t size)
      : data(static_cast<T*>(Eigen::internal::aligned_malloc(std::max<int64_t>(size, 1) * sizeof(T)))) {}
  ~LaneBuffer() { Eigen::internal::aligned_free(data); }
  LaneBuffer(const LaneBuffer&) = delete;
  LaneBuffer& operator=(const LaneBuffer&) = delete;
  T* const data;
};

// dst[c * kLanes + s] = rows[s][c] for c < n and s < kLanes: kLanes rows of n values
// become n packets holding one row in each lane.
template <typename T>
void ToLanes(const T* const* rows, int64_t n, T* dst) {
  constexpr int kL = kLanes<T>;
  Eigen::internal::PacketBlock<Packet<T>, kL> block;
  int64_t c = 0;
  for (; c + kL <= n; c += kL) {
    for (int s = 0; s < kL; ++s) block.packet[s] = Eigen::internal::ploadu<Packet<T>>(rows[s] + c);
    Eigen::internal::ptranspose(block);
    for (int t = 0; t < kL; ++t) Eigen::internal::pstore(dst + (c + t) * kL, block.packet[t]);
  }
  for (; c < n; ++c) {
    for (int s = 0; s < kL; ++s) dst[c * kL + s] = rows[s][c];
  }
}

// The inverse of ToLanes for the first `valid` rows: rows[s][c] = src[c * kLanes + s].
template <typename T>
void FromLanes(const T* src, int64_t n, T* const* rows, int valid) {
  constexpr int kL = kLanes<T>;
  Eigen::internal::PacketBlock<Packet<T>, kL> block;
  int64_t c = 0;
  for (; c + kL <= n; c += kL) {
    for (int t = 0; t < kL; ++t) block.packet[t] = Eigen::internal::pload<Packet<T>>(src + (c + t) * kL);
    Eigen::internal::ptranspose(block);
    for (int s = 0; s < valid; ++s) Eigen::internal::pstoreu(rows[s] + c, block.packet[s]);
  }
  for (; c < n; ++c) {
    for (int s = 0; s < valid; ++s) rows[s][c] = src[c * kL + s];
  }
}

// Runs fn(samples, valid, scratch) for each block of kLanes<T> samples of the batch, on
// the intra-op pool (work items of kSamplesPerItem samples) when the work is large
// enough. samples[s] is the batch index of lane s; a short last block repeats its last
// sample in the lanes from `valid` on, so that every lane reads real data. scratch
// holds scratch_size aligned values, the work item's own.
template <typename T, typename Fn>
void ForLaneBlocks(OpKernelContext* ctx, int64_t batch, int64_t work_per_sample,
                   int64_t scratch_size, const Fn& fn) {
  constexpr int kL = kLanes<T>;
  static_assert(kSamplesPerItem % kL == 0, "work items must hold whole lane blocks");
  const int64_t items = (batch + kSamplesPerItem - 1) / kSamplesPerItem;
  RunWorkItems(ctx, items, batch * work_per_sample >= kMinParallelWork, [&](int64_t item) {
    LaneBuffer<T> scratch(scratch_size);
    const int64_t end = std::min(batch, (item + 1) * kSamplesPerItem);
    for (int64_t b = item * kSamplesPerItem; b < end; b += kL) {
      int64_t samples[kL];
      for (int s = 0; s < kL; ++s) samples[s] = std::min(b + s, end - 1);
      fn(samples, static_cast<int>(std::min<int64_t>(kL, end - b)), scratch.data);
    }
  });
}

// Pairs that share their left feature, computed together so that the left row is
// loaded once for all of them (a short group repeats its last pair, whose copy
// writes a scratch slot).
constexpr int kDotGroup = 4;
struct DotGroup {
  int64_t left;
  int64_t right[kDotGroup];
  int64_t out[kDotGroup];
};

template <typename T>
class PairwiseDotsOp : public OpKernel {
 public:
  explicit PairwiseDotsOp(OpKernelConstruction* c) : OpKernel(c) {
    OP_REQUIRES_OK(c, pairs_.Init(c));
    OP_REQUIRES_OK(c, c->GetAttr("pairs_column", &pairs_column_));
    OP_REQUIRES_OK(c, c->GetAttr("width", &width_));
    OP_REQUIRES_OK(c, c->GetAttr("dense_columns", &dense_columns_));
    int num_dense;
    OP_REQUIRES_OK(c, c->GetAttr("M", &num_dense));
    OP_REQUIRES(c, dense_columns_.size() == num_dense,
                errors::InvalidArgument(kDotsOp, ": dense_columns needs one entry per dense input (",
                                        num_dense, "); got ", dense_columns_.size()));
    std::vector<int64_t> order(pairs_.size());
    for (int64_t p = 0; p < pairs_.size(); ++p) order[p] = p;
    std::stable_sort(order.begin(), order.end(),
                     [&](int64_t a, int64_t b) { return pairs_.left[a] < pairs_.left[b]; });
    for (size_t e = 0; e < order.size();) {
      DotGroup group{pairs_.left[order[e]], {}, {}};
      for (int w = 0; w < kDotGroup; ++w) {
        const bool own = e < order.size() && pairs_.left[order[e]] == group.left;
        group.right[w] = own ? pairs_.right[order[e]] : group.right[w - 1];
        group.out[w] = own ? order[e++] : pairs_.size();  // past the last pair: scratch
      }
      groups_.push_back(group);
    }
  }

  void Compute(OpKernelContext* ctx) override {
    constexpr int kL = kLanes<T>;
    using Eigen::internal::pload;
    using Eigen::internal::pmadd;
    using Eigen::internal::pset1;
    using Eigen::internal::pstore;
    const Tensor& x = ctx->input(0);
    OpInputList dense;
    OP_REQUIRES_OK(ctx, ctx->input_list("dense", &dense));
    OP_REQUIRES_OK(ctx, pairs_.Check(kDotsOp, x));
    const int64_t batch = x.dim_size(0), f = x.dim_size(1), d = x.dim_size(2);
    const int64_t num_pairs = pairs_.size();
    std::vector<std::pair<int64_t, int64_t>> spans = {{pairs_column_, num_pairs}};
    for (int m = 0; m < dense.size(); ++m) {
      OP_REQUIRES(ctx, dense[m].dims() == 2 && dense[m].dim_size(0) == batch,
                  errors::InvalidArgument(kDotsOp, ": dense input ", m, " must be [", batch,
                                          ", width] (x's batch); got shape ",
                                          dense[m].shape().DebugString()));
      spans.push_back({dense_columns_[m], dense[m].dim_size(1)});
    }
    OP_REQUIRES_OK(ctx, ::picasso::CheckColumnsFilled(kDotsOp, spans, width_, batch));
    Tensor* output;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({batch, width_}), &output));
    const T* in = x.flat<T>().data();
    T* out = output->flat<T>().data();
    // Scratch: x's block in lanes ([f * d][kL]), then the dot products ([pairs + 1][kL],
    // the last for the repeated pairs of short groups).
    const int64_t dots_at = f * d * kL;
    ForLaneBlocks<T>(ctx, batch, num_pairs * d, dots_at + (num_pairs + 1) * kL,
                     [&](const int64_t* samples, int valid, T* scratch) {
      const T* xt = scratch;
      T* dots = scratch + dots_at;
      const T* x_rows[kL];
      T* out_rows[kL];
      for (int s = 0; s < kL; ++s) {
        x_rows[s] = in + samples[s] * f * d;
        out_rows[s] = out + samples[s] * width_ + pairs_column_;
      }
      ToLanes(x_rows, f * d, scratch);
      for (const DotGroup& g : groups_) {
        const T* a = xt + g.left * d * kL;
        const T* b[kDotGroup];
        Packet<T> sums[kDotGroup];
        for (int w = 0; w < kDotGroup; ++w) {
          b[w] = xt + g.right[w] * d * kL;
          sums[w] = pset1<Packet<T>>(T(0));
        }
        for (int64_t k = 0; k < d; ++k) {
          const Packet<T> ak = pload<Packet<T>>(a + k * kL);
          for (int w = 0; w < kDotGroup; ++w) sums[w] = pmadd(ak, pload<Packet<T>>(b[w] + k * kL), sums[w]);
        }
        for (int w = 0; w < kDotGroup; ++w) pstore(dots + g.out[w] * kL, sums[w]);
      }
      FromLanes(dots, num_pairs, out_rows, valid);
      for (int m = 0; m < dense.size(); ++m) {
        const int64_t w = dense[m].dim_size(1);
        const T* src = dense[m].flat<T>().data();
        for (int s = 0; s < valid; ++s) {
          std::copy_n(src + samples[s] * w, w, out + samples[s] * width_ + dense_columns_[m]);
        }
      }
    });
  }

 private:
  Pairs pairs_;
  std::vector<DotGroup> groups_;
  int64_t pairs_column_, width_;
  std::vector<int64_t> dense_columns_;
};

// dxt[k][lanes] = sum over feature i's entries (p, other) of gt[p] * xt[other * d + k]
// for the kWidth columns k of [k0, k0 + kWidth), the sums in registers.
template <int kWidth, typename T>
void SumPartnerColumns(const Pairs& pairs, int64_t i, int64_t d, int64_t k0, const T* gt,
                       const T* xt, T* dxt) {
  constexpr int kL = kLanes<T>;
  using Eigen::internal::pload;
  using Eigen::internal::pmadd;
  Packet<T> sums[kWidth];
  for (int w = 0; w < kWidth; ++w) sums[w] = Eigen::internal::pset1<Packet<T>>(T(0));
  for (int64_t e = pairs.PartnersBegin(i), end = pairs.PartnersEnd(i); e < end; ++e) {
    const auto [p, other] = pairs.partners[e];
    const Packet<T> g = pload<Packet<T>>(gt + p * kL);
    const T* column = xt + (other * d + k0) * kL;
    for (int w = 0; w < kWidth; ++w) sums[w] = pmadd(g, pload<Packet<T>>(column + w * kL), sums[w]);
  }
  for (int w = 0; w < kWidth; ++w) Eigen::internal::pstore(dxt + (i * d + k0 + w) * kL, sums[w]);
}

template <typename T>
class PairwiseDotsGradOp : public OpKernel {
 public:
  explicit PairwiseDotsGradOp(OpKernelConstruction* c) : OpKernel(c) {
    OP_REQUIRES_OK(c, pairs_.Init(c));
    OP_REQUIRES_OK(c, c->GetAttr("pairs_column", &pairs_column_));
  }

  void Compute(OpKernelContext* ctx) override {
    constexpr int kL = kLanes<T>;
    const Tensor& x = ctx->input(0);
    const Tensor& grad = ctx->input(1);
    OP_REQUIRES_OK(ctx, pairs_.Check(kGradOp, x));
    const int64_t batch = x.dim_size(0), f = x.dim_size(1), d = x.dim_size(2);
    const int64_t num_pairs = pairs_.size();
    OP_REQUIRES(ctx, grad.dims() == 2 && grad.dim_size(0) == batch &&
                         grad.dim_size(1) >= pairs_column_ + num_pairs,
                errors::InvalidArgument(kGradOp, ": grad must be [", batch, ", width] with its ",
                                        num_pairs, " pairs from column ", pairs_column_, "; got ",
                                        grad.shape().DebugString()));
    const int64_t grad_width = grad.dim_size(1);
    Tensor* x_grad;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, x.shape(), &x_grad));
    const T* in = x.flat<T>().data();
    const T* dy = grad.flat<T>().data();
    T* dx = x_grad->flat<T>().data();
    // Scratch, all in lanes: x's block [f * d][kL], its gradient's, and grad's [pairs][kL].
    const int64_t rows_size = f * d * kL;
    ForLaneBlocks<T>(ctx, batch, 2 * num_pairs * d, 2 * rows_size + num_pairs * kL,
                     [&](const int64_t* samples, int valid, T* scratch) {
      T* xt = scratch;
      T* dxt = scratch + rows_size;
      T* gt = scratch + 2 * rows_size;
      const T* x_rows[kL];
      const T* grad_rows[kL];
      T* dx_rows[kL];
      for (int s = 0; s < kL; ++s) {
        x_rows[s] = in + samples[s] * f * d;
        grad_rows[s] = dy + samples[s] * grad_width + pairs_column_;
        dx_rows[s] = dx + samples[s] * f * d;
      }
      ToLanes(x_rows, f * d, xt);
      ToLanes(grad_rows, num_pairs, gt);
      for (int64_t i = 0; i < f; ++i) {
        int64_t k = 0;  // 8 columns at a time, then 4, 2, 1: the sums fit in registers
        for (; k + 8 <= d; k += 8) SumPartnerColumns<8>(pairs_, i, d, k, gt, xt, dxt);
        if (k + 4 <= d) SumPartnerColumns<4>(pairs_, i, d, k, gt, xt, dxt), k += 4;
        if (k + 2 <= d) SumPartnerColumns<2>(pairs_, i, d, k, gt, xt, dxt), k += 2;
        if (k < d) SumPartnerColumns<1>(pairs_, i, d, k, gt, xt, dxt);
      }
      FromLanes(dxt, f * d, dx_rows, valid);
    });
  }

 private:
  Pairs pairs_;
  int64_t pairs_column_;
};

#define PICASSO_REGISTER_PAIRWISE_DOTS(T)                                                   \
  REGISTER_KERNEL_BUILDER(Name("PicassoPairwiseDots").Device(DEVICE_CPU).TypeConstraint<T>("T"), \
                          PairwiseDotsOp<T>);                                               \
  REGISTER_KERNEL_BUILDER(                                                                  \
      Name("PicassoPairwiseDotsGrad").Device(DEVICE_CPU).TypeConstraint<T>("T"),            \
      PairwiseDotsGradOp<T>)

PICASSO_REGISTER_PAIRWISE_DOTS(float);
PICASSO_REGISTER_PAIRWISE_DOTS(double);

#undef PICASSO_REGISTER_PAIRWISE_DOTS
#undef PICASSO_PAIRS_ATTRS

}  // namespace
}  // namespace picasso
}  // namespace tensorflow
