// PicassoPairwiseDots: the pairwise dot products of a DLRM-style feature interaction,
//   output[b, p] = sum_k x[b, left[p], k] * x[b, right[p], k]      x [B, F, d]
// which models write as tf.matmul(x, x, transpose_b=True) ([B, F, F]) followed by a
// gather of some of its entries (e.g. the strictly lower triangle). Stock TF then
// spends most of that layer's time outside the arithmetic: the gather copies single
// floats, and its gradient scatters them back into a [B, F, F] tensor that two
// batched products and their transposes turn into x's gradient.
//
// Here each sample is one work unit that stays in L1. The forward copies its F x d
// rows transposed ([d, F], F padded to whole vector registers) and computes the Gram
// matrix rows it needs, kRowBlock rows at a time (RowBlockProduct: for each k, one
// packet of the transposed copy meets kRowBlock broadcast values of x, the partial
// sums staying in registers); the wanted entries are read from them. The gradient,
// PicassoPairwiseDotsGrad, gives feature i the sum of grad[b, p] * x[b, other] over
// the pairs p that i is in (`other` their other feature; the pairs are sorted by
// feature once, when the kernel is built). Sums run in their own order: equal to the
// batched MatMul's up to rounding.
#define EIGEN_USE_THREADS

#include <algorithm>
#include <vector>

#include "picasso_common.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace tensorflow {
namespace picasso {
namespace {

using ::picasso::kLanes;
using ::picasso::Packet;
using ::picasso::RunWorkItems;
using shape_inference::InferenceContext;
using shape_inference::ShapeHandle;

// Rows whose partial sums stay in vector registers together.
constexpr int kRowBlock = 4;
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

REGISTER_OP("PicassoPairwiseDots")
    .Input("x: T")
    .Output("output: T")
    .Attr("T: {float, double}")
    .Attr("left: list(int) >= 0")
    .Attr("right: list(int) >= 0")
    .SetShapeFn([](InferenceContext* c) {
      TF_RETURN_IF_ERROR(CheckPairs(c));
      std::vector<int64_t> left;
      TF_RETURN_IF_ERROR(c->GetAttr("left", &left));
      c->set_output(0, c->Matrix(c->Dim(c->input(0), 0), static_cast<int64_t>(left.size())));
      return OkStatus();
    })
    .Doc(R"doc(
For x [B, F, d], the output [B, P] holds the dot products of the feature pairs
(left[p], right[p]) of every sample.
)doc");

REGISTER_OP("PicassoPairwiseDotsGrad")
    .Input("x: T")
    .Input("grad: T")
    .Output("x_grad: T")
    .Attr("T: {float, double}")
    .Attr("left: list(int) >= 0")
    .Attr("right: list(int) >= 0")
    .SetShapeFn([](InferenceContext* c) {
      TF_RETURN_IF_ERROR(CheckPairs(c));
      c->set_output(0, c->input(0));
      return OkStatus();
    })
    .Doc(R"doc(
The gradient of PicassoPairwiseDots with respect to x, given the gradient of its
output [B, P].
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

// n rounded up to whole packets of T.
template <typename T>
int64_t RoundUp(int64_t n) {
  return (n + kLanes<T> - 1) / kLanes<T> * kLanes<T>;
}

// out[q, 0:kLanes) = sum_k a[q, k] * b[k, 0:kLanes) for the kRowBlock rows q, where
// a[q, k] = a_rows[q][k] and b[k] starts at b + k * b_stride: the partial sums of the
// rows stay in registers, each b packet is loaded once for all of them.
template <typename T>
void RowBlockProduct(const T* const* a_rows, int64_t n, const T* b,
                     int64_t b_stride, Packet<T>* out) {
  using Eigen::internal::pmadd;
  using Eigen::internal::ploadu;
  using Eigen::internal::pset1;
  for (int q = 0; q < kRowBlock; ++q) out[q] = pset1<Packet<T>>(T(0));
  for (int64_t k = 0; k < n; ++k) {
    const Packet<T> bk = ploadu<Packet<T>>(b + k * b_stride);
    for (int q = 0; q < kRowBlock; ++q) {
      out[q] = pmadd(pset1<Packet<T>>(a_rows[q][k]), bk, out[q]);
    }
  }
}

// Runs fn(first_sample, end_sample) over the batch of x [B, F, d] in work items of
// kSamplesPerItem samples, on the intra-op pool when the work is large enough.
template <typename Fn>
void ForSampleBlocks(OpKernelContext* ctx, const Tensor& x, int64_t work_per_sample, const Fn& fn) {
  const int64_t batch = x.dim_size(0);
  const int64_t items = (batch + kSamplesPerItem - 1) / kSamplesPerItem;
  RunWorkItems(ctx, items, batch * work_per_sample >= kMinParallelWork, [&](int64_t k) {
    fn(k * kSamplesPerItem, std::min(batch, (k + 1) * kSamplesPerItem));
  });
}

template <typename T>
class PairwiseDotsOp : public OpKernel {
 public:
  explicit PairwiseDotsOp(OpKernelConstruction* c) : OpKernel(c) { OP_REQUIRES_OK(c, pairs_.Init(c)); }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& x = ctx->input(0);
    OP_REQUIRES_OK(ctx, pairs_.Check("PicassoPairwiseDots", x));
    const int64_t batch = x.dim_size(0), f = x.dim_size(1), d = x.dim_size(2);
    const int64_t num_pairs = pairs_.size();
    Tensor* output;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({batch, num_pairs}), &output));
    // Gram rows are needed only for the features that are some pair's left side, and
    // each only up to its largest right side (the lower triangle: half of them).
    std::vector<int64_t> row_end(f, 0);
    for (int64_t p = 0; p < num_pairs; ++p) {
      row_end[pairs_.left[p]] = std::max(row_end[pairs_.left[p]], pairs_.right[p] + 1);
    }
    std::vector<int64_t> rows;
    for (int64_t i = 0; i < f; ++i) {
      if (row_end[i] > 0) rows.push_back(i);
    }
    const int64_t f_pad = RoundUp<T>(f);
    // The output's runs of pairs that are neighbours in the Gram rows ((i, j), (i, j + 1),
    // ...: a lower triangle has one per row), each copied at once.
    struct Run {
      int64_t pair, gram, length;
    };
    std::vector<Run> runs;
    for (int64_t p = 0; p < num_pairs; ++p) {
      const int64_t at = pairs_.left[p] * f_pad + pairs_.right[p];
      if (!runs.empty() && runs.back().pair + runs.back().length == p &&
          runs.back().gram + runs.back().length == at) {
        ++runs.back().length;
      } else {
        runs.push_back({p, at, 1});
      }
    }
    const T* in = x.flat<T>().data();
    T* out = output->flat<T>().data();
    ForSampleBlocks(ctx, x, static_cast<int64_t>(rows.size()) * f * d, [&](int64_t b0, int64_t b1) {
      std::vector<T> transposed(d * f_pad, T(0)), gram(f * f_pad);
      Packet<T> sums[kRowBlock];
      for (int64_t b = b0; b < b1; ++b) {
        const T* xb = in + b * f * d;
        for (int64_t j = 0; j < f; ++j) {
          for (int64_t k = 0; k < d; ++k) transposed[k * f_pad + j] = xb[j * d + k];
        }
        for (size_t r = 0; r < rows.size(); r += kRowBlock) {
          const T* a_rows[kRowBlock];
          int64_t block[kRowBlock], end = 0;
          for (int q = 0; q < kRowBlock; ++q) {  // a short last block repeats its last row
            block[q] = rows[std::min(r + q, rows.size() - 1)];
            a_rows[q] = xb + block[q] * d;
            end = std::max(end, row_end[block[q]]);
          }
          for (int64_t c = 0; c < end; c += kLanes<T>) {
            RowBlockProduct(a_rows, d, transposed.data() + c, f_pad, sums);
            for (int q = 0; q < kRowBlock; ++q) {
              Eigen::internal::pstoreu(gram.data() + block[q] * f_pad + c, sums[q]);
            }
          }
        }
        T* ob = out + b * num_pairs;
        for (const Run& run : runs) {
          std::copy(gram.data() + run.gram, gram.data() + run.gram + run.length, ob + run.pair);
        }
      }
    });
  }

 private:
  Pairs pairs_;
};

template <typename T>
class PairwiseDotsGradOp : public OpKernel {
 public:
  explicit PairwiseDotsGradOp(OpKernelConstruction* c) : OpKernel(c) {
    OP_REQUIRES_OK(c, pairs_.Init(c));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& x = ctx->input(0);
    const Tensor& grad = ctx->input(1);
    OP_REQUIRES_OK(ctx, pairs_.Check("PicassoPairwiseDotsGrad", x));
    const int64_t batch = x.dim_size(0), f = x.dim_size(1), d = x.dim_size(2);
    const int64_t num_pairs = pairs_.size();
    OP_REQUIRES(ctx, grad.shape() == TensorShape({batch, num_pairs}),
                errors::InvalidArgument("PicassoPairwiseDotsGrad: grad must be [", batch, ", ",
                                        num_pairs, "] (batch, pairs); got ",
                                        grad.shape().DebugString()));
    Tensor* x_grad;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, x.shape(), &x_grad));
    const T* in = x.flat<T>().data();
    const T* dy = grad.flat<T>().data();
    T* dx = x_grad->flat<T>().data();
    const int64_t d_pad = RoundUp<T>(d);
    ForSampleBlocks(ctx, x, 2 * num_pairs * d, [&](int64_t b0, int64_t b1) {
      using Eigen::internal::padd;
      using Eigen::internal::pmadd;
      using Eigen::internal::ploadu;
      using Eigen::internal::pset1;
      // Rows padded to whole packets, unless they are already.
      std::vector<T> padded(d == d_pad ? 0 : f * d_pad, T(0));
      for (int64_t b = b0; b < b1; ++b) {
        const T* gb = dy + b * num_pairs;
        const T* xb = in + b * f * d;
        const T* rows = xb;
        if (d != d_pad) {
          for (int64_t j = 0; j < f; ++j) std::copy(xb + j * d, xb + (j + 1) * d, &padded[j * d_pad]);
          rows = padded.data();
        }
        T* dxb = dx + b * f * d;
        for (int64_t i = 0; i < f; ++i) {
          const int64_t begin = pairs_.PartnersBegin(i), end = pairs_.PartnersEnd(i);
          for (int64_t c = 0; c < d; c += kLanes<T>) {
            // Four interleaved sums, so that the multiply-adds do not wait on each
            // other's results.
            const auto term = [&](int64_t e, const Packet<T>& sum) {
              const auto [p, other] = pairs_.partners[e];
              return pmadd(pset1<Packet<T>>(gb[p]), ploadu<Packet<T>>(rows + other * d_pad + c), sum);
            };
            Packet<T> s0 = pset1<Packet<T>>(T(0)), s1 = s0, s2 = s0, s3 = s0;
            int64_t e = begin;
            for (; e + 4 <= end; e += 4) {
              s0 = term(e, s0);
              s1 = term(e + 1, s1);
              s2 = term(e + 2, s2);
              s3 = term(e + 3, s3);
            }
            for (; e < end; ++e) s0 = term(e, s0);
            T lanes[kLanes<T>];
            Eigen::internal::pstoreu(lanes, padd(padd(s0, s1), padd(s2, s3)));
            std::copy(lanes, lanes + std::min(kLanes<T>, d - c), dxb + i * d + c);
          }
        }
      }
    });
  }

 private:
  Pairs pairs_;
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

}  // namespace
}  // namespace picasso
}  // namespace tensorflow
