// Helpers shared by picasso_tf's CPU kernels: scheduling work items on the op's
// intra-op thread pool, and arithmetic on embedding rows of width d.
#ifndef PICASSO_TF_CUSTOM_OPS_PICASSO_COMMON_H_
#define PICASSO_TF_CUSTOM_OPS_PICASSO_COMMON_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#include "Eigen/Core"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/platform/notification.h"

namespace picasso {

// Runs fn(i) for every i in [0, num_items) on the kernel's intra-op thread pool.
// Threads claim items one at a time from a shared counter, so items of uneven cost
// still keep every thread busy; the calling thread works too, and returns as soon as
// every item is done: a helper task still queued behind other work when the items run
// out finds none left and never touches fn. With `parallel` false (inputs too small to
// pay for waking threads) the items run inline, in order. fn must not depend on which
// thread runs an item.
template <typename Fn>
void RunWorkItems(tensorflow::OpKernelContext* ctx, int64_t num_items, bool parallel,
                  const Fn& fn) {
  auto* workers = ctx->device()->tensorflow_cpu_worker_threads()->workers;
  const int64_t num_threads =
      parallel ? std::min<int64_t>(num_items, workers->NumThreads()) : 1;
  if (num_threads <= 1) {
    for (int64_t i = 0; i < num_items; ++i) fn(i);
    return;
  }
  // Shared with the helper tasks, which may outlive this call.
  struct State {
    const Fn* fn;  // valid while an item is unfinished, which is all a helper needs
    int64_t num_items;
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> finished{0};
    tensorflow::Notification all_finished;
  };
  auto state = std::make_shared<State>();
  state->fn = &fn;
  state->num_items = num_items;
  auto drain = [](State* s) {
    for (int64_t i = s->next.fetch_add(1); i < s->num_items; i = s->next.fetch_add(1)) {
      (*s->fn)(i);
      if (s->finished.fetch_add(1) + 1 == s->num_items) s->all_finished.Notify();
    }
  };
  for (int64_t t = 1; t < num_threads; ++t) {
    workers->Schedule([state, drain]() { drain(state.get()); });
  }
  drain(state.get());
  state->all_finished.WaitForNotification();
}

// Checks that the column spans (first column, number of columns) of the parts of a
// stitched [rows, width] output fill every column exactly once (else the output would
// hold garbage). With no rows there is nothing to fill.
inline tensorflow::Status CheckColumnsFilled(const char* op,
                                             std::vector<std::pair<int64_t, int64_t>> spans,
                                             int64_t width, int64_t rows) {
  if (rows == 0) return tensorflow::OkStatus();
  std::sort(spans.begin(), spans.end());
  int64_t covered = 0;
  for (const auto& [column, span] : spans) {
    if (column != covered) {
      return tensorflow::errors::InvalidArgument(op, ": the inputs must fill columns [0, ", width,
                                                 ") exactly once; column ", covered,
                                                 " is followed by one at ", column);
    }
    covered += span;
  }
  if (covered != width) {
    return tensorflow::errors::InvalidArgument(op, ": the inputs fill ", covered,
                                               " columns, not width ", width);
  }
  return tensorflow::OkStatus();
}

// Calls fn(std::integral_constant<int64_t, kD>()) with kD = d for the usual embedding
// widths and kD = 0 for others. Row helpers take kD as a template argument: with kD > 0
// their loops have a compile-time trip count and unroll into a few vector
// instructions; with kD = 0 they loop over the run-time width d. Width 1 (the linear
// part's tables of wide and logistic models) is a case of its own: there a run-time
// loop, or a memcpy call, costs more than the value it moves.
template <typename Fn>
decltype(auto) DispatchDim(int64_t d, const Fn& fn) {
  switch (d) {
    case 1: return fn(std::integral_constant<int64_t, 1>());
    case 4: return fn(std::integral_constant<int64_t, 4>());
    case 8: return fn(std::integral_constant<int64_t, 8>());
    case 16: return fn(std::integral_constant<int64_t, 16>());
    case 32: return fn(std::integral_constant<int64_t, 32>());
    case 64: return fn(std::integral_constant<int64_t, 64>());
    case 128: return fn(std::integral_constant<int64_t, 128>());
    default: return fn(std::integral_constant<int64_t, 0>());
  }
}

// Eigen's vector register for T (16 floats with AVX-512), for hand-blocked loops.
template <typename T>
using Packet = typename Eigen::internal::packet_traits<T>::type;
template <typename T>
constexpr int64_t kLanes = Eigen::internal::unpacket_traits<Packet<T>>::size;

// A row of width kD (or d when kD is 0) as an Eigen array, so that row arithmetic is
// explicitly vectorised (a plain loop may not be, when the compiler cannot rule out
// that the rows overlap).
template <int64_t kD, typename T>
using Row = Eigen::Map<Eigen::Array<T, kD ? kD : Eigen::Dynamic, 1>>;
template <int64_t kD, typename T>
using ConstRow = Eigen::Map<const Eigen::Array<T, kD ? kD : Eigen::Dynamic, 1>>;

// dst[0, d) = src[0, d)
template <int64_t kD, typename T>
inline void CopyRow(T* dst, const T* src, int64_t d) {
  std::memcpy(dst, src, (kD ? kD : d) * sizeof(T));
}

// dst[0, d) = a * src[0, d)
template <int64_t kD, typename T>
inline void ScaleRow(T* dst, const T* src, T a, int64_t d) {
  Row<kD, T>(dst, kD ? kD : d) = a * ConstRow<kD, T>(src, kD ? kD : d);
}

// dst[0, d) += a * src[0, d)
template <int64_t kD, typename T>
inline void AxpyRow(T* dst, const T* src, T a, int64_t d) {
  Row<kD, T>(dst, kD ? kD : d) += a * ConstRow<kD, T>(src, kD ? kD : d);
}

// sum of a[k] * b[k] for k in [0, d), in 8 interleaved partial sums (which the
// compiler keeps in one vector register) added up pairwise at the end.
template <int64_t kD, typename T>
inline T DotRow(const T* a, const T* b, int64_t d) {
  constexpr int kLanes = 8;
  const int64_t n = kD ? kD : d;
  const int64_t full = n / kLanes * kLanes;
  T partial[kLanes] = {};
  for (int64_t k = 0; k < full; k += kLanes) {
    for (int l = 0; l < kLanes; ++l) partial[l] += a[k + l] * b[k + l];
  }
  for (int half = kLanes / 2; half > 0; half /= 2) {
    for (int l = 0; l < half; ++l) partial[l] += partial[l + half];
  }
  T sum = partial[0];
  for (int64_t k = full; k < n; ++k) sum += a[k] * b[k];
  return sum;
}

// Asks the CPU to start loading the cache lines of the `bytes` bytes at p (a row
// that is read soon). Only a hint: p need not be a valid address.
inline void PrefetchBytes(const void* p, int64_t bytes) {
  const uintptr_t end = reinterpret_cast<uintptr_t>(p) + bytes;
  for (uintptr_t a = reinterpret_cast<uintptr_t>(p) & ~uintptr_t{63}; a < end; a += 64) {
    __builtin_prefetch(reinterpret_cast<const void*>(a));
  }
}

// How many rows ahead the row loops prefetch: about 2 KB, but 8 to 32 rows (measured
// on AMD EPYC, widths 8 to 64 floats).
constexpr int64_t PrefetchDistance(int64_t row_bytes) {
  return std::clamp<int64_t>(2048 / std::max<int64_t>(row_bytes, 1), 8, 32);
}

}  // namespace picasso

#endif  // PICASSO_TF_CUSTOM_OPS_PICASSO_COMMON_H_
