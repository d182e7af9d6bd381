// What picasso_tf's lookup kernels share (packed_lookup_ops.cc,
// stitched_projection_ops.cc, stacked_tables_ops.cc): the sites' attributes and inputs, work items,
// grouping entries by packed row, pooled sites' segment indexes and scales, and the
// layout of stitched ops. Included only by those kernel files; like the rest of
// their code, its definitions are internal to each (an unnamed namespace).
#ifndef PICASSO_TF_CUSTOM_OPS_PACKED_SITES_H_
#define PICASSO_TF_CUSTOM_OPS_PACKED_SITES_H_

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "picasso_common.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/framework/tensor_shape.h"

namespace tensorflow {
namespace {

using ::picasso::AxpyRow;
using ::picasso::CopyRow;
using ::picasso::DispatchDim;
using ::picasso::DotRow;
using ::picasso::PrefetchBytes;
using ::picasso::PrefetchDistance;
using ::picasso::RunWorkItems;
using ::picasso::ScaleRow;
using shape_inference::DimensionHandle;
using shape_inference::InferenceContext;
using shape_inference::ShapeHandle;

// The attributes of a REGISTER_OP that PackedLayout (with combiners) and StitchLayout
// read: each listed once, so that the ops declaring them cannot drift apart.
#define PICASSO_SITE_ATTRS                        \
  .Attr("offsets: list(int)")                     \
      .Attr("vocab_sizes: list(int)")             \
      .Attr("combiners: list(string)")            \
      .Attr("feature_names: list(string)")        \
      .Attr("exchanged: bool = false")
#define PICASSO_STITCH_ATTRS .Attr("columns: list(int)").Attr("row_blocks: list(int)")

// Registers the CPU kernel (the rest of the arguments: a class that may hold commas)
// of op for one value type T and one id type Tid.
#define PICASSO_REGISTER_CPU_KERNEL(op, T, Tid, ...)                                    \
  REGISTER_KERNEL_BUILDER(                                                              \
      Name(op).Device(DEVICE_CPU).TypeConstraint<T>("T").TypeConstraint<Tid>("Tid"),    \
      __VA_ARGS__)

// Inputs with fewer bytes of rows (or, for index-only passes, fewer entries) than
// this run on the calling thread: waking the pool would cost more than it saves.
constexpr int64_t kMinParallelBytes = 256 << 10;
constexpr int64_t kMinParallelEntries = 32 << 10;
// Rows are grouped with a byte map over a cluster's row range (rather than by sorting)
// when the range has at most kDenseRowsPerEntry * entries + kDenseMinRows rows.
constexpr int64_t kDenseRowsPerEntry = 16;
constexpr int64_t kDenseMinRows = 1 << 16;
// Work items move at least this many bytes of rows; otherwise there are about
// kItemsPerThread items per thread, enough to even out uneven items.
constexpr int64_t kMinItemBytes = 32 << 10;
constexpr int64_t kItemsPerThread = 8;
// Stitched tensors are walked in blocks of rows spanning about this many bytes.
constexpr int64_t kBlockBytes = 256 << 10;

enum class Combiner { kNone, kSum, kMean, kSqrtN };
constexpr const char* kCombinerNames[] = {"none", "sum", "mean", "sqrtn"};

// ---------------------------------------------------------------------------------
// Attributes and inputs.

// The attributes that place each site in the packed table.
struct PackedLayout {
  std::vector<int64_t> offsets;
  std::vector<int64_t> vocab_sizes;
  std::vector<std::string> names;
  std::vector<Combiner> combiners;  // only for the lookup ops
  // The tables are the rows fetched for this batch (hybrid parallelism): a site's ids
  // index those rows, fewer than its vocabulary, and are checked against them.
  bool exchanged = false;

  Status Init(OpKernelConstruction* c, bool with_combiners) {
    int n;
    TF_RETURN_IF_ERROR(c->GetAttr("N", &n));
    TF_RETURN_IF_ERROR(c->GetAttr("offsets", &offsets));
    TF_RETURN_IF_ERROR(c->GetAttr("vocab_sizes", &vocab_sizes));
    TF_RETURN_IF_ERROR(c->GetAttr("feature_names", &names));
    if (c->HasAttr("exchanged")) TF_RETURN_IF_ERROR(c->GetAttr("exchanged", &exchanged));
    std::vector<std::string> combiner_names;
    if (with_combiners) {
      TF_RETURN_IF_ERROR(c->GetAttr("combiners", &combiner_names));
    } else {
      combiner_names.assign(n, "none");
    }
    if (offsets.size() != n || vocab_sizes.size() != n || names.size() != n ||
        combiner_names.size() != n) {
      return errors::InvalidArgument(
          c->def().op(), ": offsets, vocab_sizes, feature_names",
          with_combiners ? " and combiners" : "", " need one entry per site (", n,
          "); got ", offsets.size(), ", ", vocab_sizes.size(), ", ", names.size(),
          with_combiners ? strings::StrCat(" and ", combiner_names.size()) : "");
    }
    for (int i = 0; i < n; ++i) {
      if (offsets[i] < 0 || vocab_sizes[i] <= 0 ||
          offsets[i] > INT64_MAX - vocab_sizes[i]) {
        return errors::InvalidArgument(c->def().op(), ": ", Feature(i),
                                       " needs offset >= 0 and vocab_size > 0; got offset ",
                                       offsets[i], " and vocab_size ", vocab_sizes[i]);
      }
      const auto* name = std::find(std::begin(kCombinerNames), std::end(kCombinerNames),
                                   combiner_names[i]);
      if (name == std::end(kCombinerNames)) {
        return errors::InvalidArgument(c->def().op(), ": ", Feature(i), " has combiner '",
                                       combiner_names[i],
                                       "'; use one of 'none', 'sum', 'mean', 'sqrtn'");
      }
      combiners.push_back(static_cast<Combiner>(name - std::begin(kCombinerNames)));
    }
    return OkStatus();
  }

  int size() const { return static_cast<int>(offsets.size()); }

  // The layout of some of the sites, in the given order.
  PackedLayout Subset(const std::vector<int>& sites) const {
    PackedLayout sub;
    sub.exchanged = exchanged;
    for (int i : sites) {
      sub.offsets.push_back(offsets[i]);
      sub.vocab_sizes.push_back(vocab_sizes[i]);
      sub.names.push_back(names[i]);
      sub.combiners.push_back(combiners[i]);
    }
    return sub;
  }
  int64_t end_row(int i) const { return offsets[i] + vocab_sizes[i]; }
  std::string Feature(int i) const { return strings::StrCat("feature '", names[i], "'"); }

  Status CheckRows(const char* op, int64_t num_rows) const {
    for (int i = 0; i < size(); ++i) {
      if (end_row(i) > num_rows) {
        return errors::InvalidArgument(op, ": ", Feature(i), " occupies rows [", offsets[i],
                                       ", ", end_row(i), ") of the packed table, which has ",
                                       num_rows, " rows");
      }
    }
    return OkStatus();
  }
};

// Whether 0 <= id < vocab.
template <typename Tid>
inline bool InRange(Tid id, int64_t vocab) {
  return static_cast<uint64_t>(static_cast<int64_t>(id)) < static_cast<uint64_t>(vocab);
}

// One site's ids and its rows' place in the packed table.
template <typename Tid>
struct SiteIds {
  const Tid* ids = nullptr;
  int64_t n = 0;
  int64_t offset = 0;
  int64_t vocab = 0;

  bool Valid(Tid id) const { return InRange(id, vocab); }
};

// A site of the lookup ops: its ids and how they are pooled.
template <typename T, typename Tid>
struct Site : SiteIds<Tid> {
  Combiner combiner = Combiner::kNone;
  bool pooled = false;  // combiner != "none"
  // Pooled sites: the output row of each id, or null when the site pools each row of
  // its ids and no segment ids were written for it (see ReadSites; or when it has no
  // ids): then entry j pools into row j / row_length, which the loops work out from
  // their position (no divide per entry).
  const int64_t* segments = nullptr;
  int64_t row_length = 0;
  int64_t num_segments = 0;
  const T* weights = nullptr;  // null: every weight is 1
  // Segment ids written for a site that pools each row of its ids: every copy of the
  // site keeps them alive.
  Tensor row_segments;

  int64_t out_rows() const { return pooled ? num_segments : this->n; }
};

// Where row j of a site's output (or of its gradient) lies: in the site's own [n, D]
// tensor (per_row 1, stride D), or in a stitched [rows, W] tensor where each row
// holds per_row consecutive rows of the site side by side, from column base onwards.
template <typename P>
struct RowPlace {
  P* base = nullptr;
  int64_t per_row = 1;
  int64_t stride = 0;  // W (stitched) or D
  int64_t width = 0;   // D

  P* operator()(int64_t j) const {
    if (per_row == 1) return base + j * stride;
    return base + (j / per_row) * stride + (j % per_row) * width;
  }
};

// The error for the first id, in site and then position order, outside its range.
template <typename S>
Status FirstBadId(const char* op, const PackedLayout& layout, const std::vector<S>& sites) {
  for (int i = 0; i < static_cast<int>(sites.size()); ++i) {
    const S& s = sites[i];
    for (int64_t j = 0; j < s.n; ++j) {
      if (!s.Valid(s.ids[j])) {
        return errors::InvalidArgument(
            op, ": ids of ", layout.Feature(i), " must lie in [0, ", s.vocab, "): got ",
            static_cast<int64_t>(s.ids[j]), " at position ", j,
            "; raise the feature's vocabulary size or hash its ids into that range");
      }
    }
  }
  return errors::Internal(op, ": an id was out of range, but a second look found none");
}

// The error for the first segment id, in site and then position order, out of range.
template <typename T, typename Tid>
Status FirstBadSegment(const char* op, const PackedLayout& layout,
                       const std::vector<Site<T, Tid>>& sites) {
  for (int i = 0; i < static_cast<int>(sites.size()); ++i) {
    const Site<T, Tid>& s = sites[i];
    for (int64_t j = 0; s.pooled && s.segments && j < s.n; ++j) {
      if (static_cast<uint64_t>(s.segments[j]) >= static_cast<uint64_t>(s.num_segments)) {
        return errors::InvalidArgument(
            op, ": segment ids of ", layout.Feature(i), " must lie in [0, ", s.num_segments,
            ") (num_segments): got ", s.segments[j], " at position ", j,
            "; a segment id names the output row (the example) that the id at the same "
            "position is pooled into");
      }
    }
  }
  return errors::Internal(op, ": a segment id was out of range, but a second look found none");
}

// A site's output: ids.shape + [D] unpooled, [num_segments, D] pooled by segment ids,
// and ids.shape[:-1] + [D] pooled by row (ids of rank 2 or more, see ReadSites).
template <typename T, typename Tid>
TensorShape OutputShape(const Site<T, Tid>& s, const Tensor& ids, int64_t d) {
  if (s.pooled && ids.dims() < 2) return TensorShape({s.num_segments, d});
  TensorShape shape = ids.shape();
  if (s.pooled) shape.RemoveLastDims(1);
  shape.AddDim(d);
  return shape;
}

// Pooling by row: a pooled site given ids of rank 2 or more and no segment ids pools
// each row of its ids (the last axis: a sequence feature's [B, L] ids pool into [B, D]),
// as if its segment ids were j / L. Writes those segment ids if asked to (see
// ReadSites), else only its row length; weights then have the ids' shape, or it and
// [1] (a [B, L, 1] mask).
template <typename T, typename Tid>
Status PoolByRow(OpKernelContext* ctx, const Tensor& ids, bool write_segment_ids,
                 Site<T, Tid>* s) {
  TensorShape rows_shape = ids.shape();
  rows_shape.RemoveLastDims(1);
  const int64_t length = ids.dim_size(ids.dims() - 1);
  s->num_segments = rows_shape.num_elements();
  s->row_length = length;
  if (!write_segment_ids) return OkStatus();
  TF_RETURN_IF_ERROR(ctx->allocate_temp(DT_INT64, TensorShape({s->n}), &s->row_segments));
  int64_t* segments = s->row_segments.template flat<int64_t>().data();
  for (int64_t j = 0, row = 0; j < s->n; ++row) {  // segment j / L, without a division per id
    for (int64_t k = 0; k < length; ++k) segments[j++] = row;
  }
  s->segments = segments;
  return OkStatus();
}

// Reads the per-site inputs of PicassoPackedLookup and its gradient, checking shapes.
// Sites that pool by row get segment ids written only with write_row_segment_ids (for
// loops that read each entry's segment id); otherwise their row length stands for them.
template <typename T, typename Tid>
Status ReadSites(OpKernelContext* ctx, const char* op, const PackedLayout& layout,
                 std::vector<Site<T, Tid>>* sites, bool write_row_segment_ids = false) {
  OpInputList ids, segments, weights, num_segments;
  TF_RETURN_IF_ERROR(ctx->input_list("ids", &ids));
  TF_RETURN_IF_ERROR(ctx->input_list("segment_ids", &segments));
  TF_RETURN_IF_ERROR(ctx->input_list("weights", &weights));
  TF_RETURN_IF_ERROR(ctx->input_list("num_segments", &num_segments));
  sites->resize(layout.size());
  int64_t total = 0;
  for (int i = 0; i < layout.size(); ++i) {
    Site<T, Tid>& s = (*sites)[i];
    const Combiner combiner = layout.combiners[i];
    const char* combiner_name = kCombinerNames[static_cast<int>(combiner)];
    // Unpooled ids may have any shape (the output is ids.shape + [D]); pooled ids are flat
    // but for pooling by row.
    const bool by_row = combiner != Combiner::kNone && ids[i].dims() >= 2 &&
                        segments[i].NumElements() == 0;
    if ((combiner != Combiner::kNone && !by_row && !TensorShapeUtils::IsVector(ids[i].shape())) ||
        !TensorShapeUtils::IsVector(segments[i].shape()) ||
        (!by_row && !TensorShapeUtils::IsVector(weights[i].shape()))) {
      return errors::InvalidArgument(
          op, ": ids (when pooled by segment ids), segment_ids and weights of ", layout.Feature(i),
          " must be vectors; got shapes ", ids[i].shape().DebugString(), ", ",
          segments[i].shape().DebugString(), " and ", weights[i].shape().DebugString());
    }
    s.ids = ids[i].flat<Tid>().data();
    s.n = ids[i].NumElements();
    s.offset = layout.offsets[i];
    s.vocab = layout.vocab_sizes[i];
    s.combiner = combiner;
    s.pooled = combiner != Combiner::kNone;
    if (by_row) {
      TF_RETURN_IF_ERROR(PoolByRow(ctx, ids[i], write_row_segment_ids, &s));
    } else if (s.pooled) {
      if (segments[i].NumElements() != s.n) {
        return errors::InvalidArgument(
            op, ": ", layout.Feature(i), " has combiner '", combiner_name, "' and ", s.n,
            " ids, so segment_ids needs ", s.n, " entries (the output row of each id); got ",
            segments[i].NumElements());
      }
      if (!TensorShapeUtils::IsScalar(num_segments[i].shape()) ||
          num_segments[i].scalar<int64_t>()() < 0) {
        return errors::InvalidArgument(op, ": num_segments of ", layout.Feature(i),
                                       " must be a scalar >= 0; got ",
                                       num_segments[i].DebugString());
      }
      s.segments = segments[i].flat<int64_t>().data();
      s.num_segments = num_segments[i].scalar<int64_t>()();
    } else if (segments[i].NumElements() != 0) {
      return errors::InvalidArgument(
          op, ": ", layout.Feature(i), " has combiner 'none' (no pooling), so its "
          "segment_ids must be empty; got ", segments[i].NumElements(), " entries");
    }
    if (by_row && weights[i].NumElements() != 0 && weights[i].shape() != ids[i].shape()) {
      TensorShape with_one = ids[i].shape();
      with_one.AddDim(1);
      if (weights[i].shape() != with_one) {
        return errors::InvalidArgument(
            op, ": weights of ", layout.Feature(i), " pool its ids ", ids[i].shape().DebugString(),
            " by row, so they need the ids' shape (or it and [1]); got ",
            weights[i].shape().DebugString(), ". The model multiplies the feature's looked-up rows "
            "by weights of another shape; train it with sequence_pooling=False");
      }
    }
    if (weights[i].NumElements() != 0 && weights[i].NumElements() != s.n) {
      return errors::InvalidArgument(op, ": weights of ", layout.Feature(i),
                                     " must be empty (all 1) or have one entry per id (",
                                     s.n, "); got ", weights[i].NumElements());
    }
    if (weights[i].NumElements() != 0) s.weights = weights[i].flat<T>().data();
    total += s.n;
  }
  if (total > INT32_MAX) {
    return errors::InvalidArgument(op, ": at most 2^31 - 1 ids per call; got ", total);
  }
  return OkStatus();
}

int NumThreads(OpKernelContext* ctx) {
  return ctx->device()->tensorflow_cpu_worker_threads()->num_threads;
}

// Work items: a site (or cluster) and a range [begin, end) of its entries, segments
// or unique rows.
struct WorkItem {
  int unit;
  int64_t begin;
  int64_t end;
};

// Appends items splitting [0, count) of `unit` into pieces of about `target` cost,
// where cum(k) is the (non-decreasing) cost of [0, k).
template <typename CumFn>
void SplitWork(int unit, int64_t count, int64_t target, const CumFn& cum,
               std::vector<WorkItem>* items) {
  if (count == 0) return;
  const int64_t cost = cum(count);
  const int64_t pieces = std::max<int64_t>(1, std::min(count, cost / target));
  int64_t begin = 0;
  for (int64_t p = 1; p <= pieces && begin < count; ++p) {
    int64_t end = count;
    if (p < pieces) {
      // The first k > begin whose cumulative cost reaches p / pieces of the total.
      int64_t lo = begin + 1, hi = count;
      const int64_t goal = cost / pieces * p;
      while (lo < hi) {
        const int64_t mid = lo + (hi - lo) / 2;
        if (cum(mid) >= goal) {
          hi = mid;
        } else {
          lo = mid + 1;
        }
      }
      end = lo;
    }
    items->push_back({unit, begin, end});
    begin = end;
  }
}



// ---------------------------------------------------------------------------------
// Grouping entries by packed row (PicassoPackedUnique and the gradient).

// The entries of all sites grouped by packed row. Sites whose row ranges overlap (two
// sites sharing a table) form one cluster; clusters cover disjoint row ranges, in
// ascending order, and are grouped independently and in parallel. A cluster numbers
// its entries site by site in input order ("local entries") and maps each to the
// index of its row among the cluster's distinct rows, which ascend.
struct RowClusters {
  struct Cluster {
    int64_t lo = 0, hi = 0;               // packed rows [lo, hi)
    std::vector<int> sites;               // ascending
    std::vector<int64_t> site_begin;      // each site's first local entry, then the total
    std::vector<int64_t> rows;            // the distinct packed rows, ascending
    std::unique_ptr<uint32_t[]> inverse;  // per local entry, its row's index in `rows`
    int64_t unique_begin = 0;             // index of rows[0] among all clusters' rows

    int64_t num_entries() const { return site_begin.back(); }
    int64_t num_unique() const { return static_cast<int64_t>(rows.size()); }
  };
  std::vector<Cluster> clusters;
  int64_t num_unique = 0;
};

// GroupDense's scratch, one per thread and kept between calls (a cluster is grouped
// every step, and allocating and zeroing its byte map each time measured a visible
// share of a gradient): the byte map is all zero between calls, each call clearing
// what it marked. Scratch for clusters wider than kKeptDenseRows rows is freed after use.
struct DenseScratch {
  std::vector<uint8_t> seen;
  std::vector<uint64_t> marks;  // one bit per row, 64 rows a word
  std::vector<uint32_t> rank;
};
constexpr int64_t kKeptDenseRows = 1 << 18;  // about 1.3 MB of scratch per thread

// A GroupDense that only groups (see GroupDense's hooks).
struct GroupOnly {
  static constexpr bool kInverse = true;
  void Entry(int64_t /*entry*/, int64_t /*row*/) {}
  void Row(int64_t /*u*/, int64_t /*row*/) {}
};

// Groups a cluster by marking its rows in a byte map over [lo, hi) and numbering the
// marked ones in order: for clusters not much wider than their number of entries.
// False on a bad id. The hooks let a caller do per-entry work in the marking pass
// (hooks.Entry(entry, row), rows relative to lo, for each entry of a valid call's
// sites in order, and of a bad call's up to its bad id) and per-row work as the rows
// are numbered (hooks.Row(u, row), u ascending); without kInverse no inverse is kept.
template <typename S, typename Hooks = GroupOnly>
bool GroupDense(const std::vector<S>& sites, RowClusters::Cluster* c, Hooks hooks = {}) {
  thread_local DenseScratch scratch;
  const int64_t words = (c->hi - c->lo + 63) / 64, padded = words * 64;
  if (static_cast<int64_t>(scratch.seen.size()) < padded) {
    scratch.seen.resize(padded, 0);
    scratch.rank.resize(padded);
  }
  scratch.marks.resize(words);
  uint8_t* seen = scratch.seen.data();
  uint32_t* rank = scratch.rank.data();
  bool valid = true;
  for (size_t k = 0; k < c->sites.size() && valid; ++k) {
    // Locals, which the byte stores cannot alias, so they stay in registers.
    const S& s = sites[c->sites[k]];
    const int64_t site_lo = s.offset - c->lo;
    uint8_t* site_seen = seen + site_lo;
    const auto* ids = s.ids;
    const int64_t n = s.n, vocab = s.vocab, entry0 = c->site_begin[k];
    for (int64_t j = 0; j < n; ++j) {
      if (!InRange(ids[j], vocab)) {
        valid = false;
        break;
      }
      site_seen[ids[j]] = 1;
      hooks.Entry(entry0 + j, site_lo + ids[j]);
    }
  }
  // Pack the marks into bits 64 rows at a time (one multiplication turns 8
  // little-endian 0/1 bytes into 8 bits), clearing the byte map behind them.
  int64_t num_unique = 0;
  for (int64_t w = 0; w < words; ++w) {
    uint64_t mask = 0;
    uint8_t* bytes = seen + w * 64;
    for (int b = 0; b < 64; b += 8) {
      uint64_t eight;
      std::memcpy(&eight, bytes + b, 8);
      mask |= ((eight * 0x0102040810204080ull) >> 56) << b;
    }
    std::memset(bytes, 0, 64);
    scratch.marks[w] = mask;
    num_unique += __builtin_popcountll(mask);
  }
  if (valid) {
    c->rows.resize(num_unique);
    int64_t u = 0;
    for (int64_t w = 0; w < words; ++w) {
      for (uint64_t mask = scratch.marks[w]; mask != 0; mask &= mask - 1, ++u) {
        const int64_t row = w * 64 + __builtin_ctzll(mask);
        rank[row] = static_cast<uint32_t>(u);
        c->rows[u] = c->lo + row;
        hooks.Row(u, row);
      }
    }
    for (size_t k = 0; k < c->sites.size() && Hooks::kInverse; ++k) {
      const S& s = sites[c->sites[k]];
      const uint32_t* site_rank = rank + (s.offset - c->lo);
      uint32_t* inverse = c->inverse.get() + c->site_begin[k];
      for (int64_t j = 0; j < s.n; ++j) inverse[j] = site_rank[s.ids[j]];
    }
  }
  if (padded > kKeptDenseRows) scratch = DenseScratch();
  return valid;
}

// Sorts v[0, m) by bits [32, 32 + bits) of each value, keeping values with equal keys
// in their order: LSD radix sort, digits of at most 11 bits, tmp scratch for m values.
// Where std::sort is cheaper it is used instead; it gives the same order because the
// values are distinct and their low 32 bits ascend within each key.
void SortByKey(uint64_t* v, uint64_t* tmp, int64_t m, int bits) {
  if (bits == 0 || m < 2) return;
  const int passes = (bits + 10) / 11;
  const int digit = (bits + passes - 1) / passes;
  const int64_t buckets = int64_t{1} << digit;
  int64_t log_m = 0;
  while ((int64_t{1} << log_m) < m) ++log_m;
  if (passes * (2 * m + buckets) > m * log_m) {
    std::sort(v, v + m);
    return;
  }
  uint32_t count[3][1 << 11];
  for (int pass = 0; pass < passes; ++pass) std::fill(count[pass], count[pass] + buckets, 0);
  const uint64_t mask = buckets - 1;
  for (int64_t p = 0; p < m; ++p) {
    const uint64_t key = v[p] >> 32;
    for (int pass = 0; pass < passes; ++pass) ++count[pass][(key >> (pass * digit)) & mask];
  }
  uint64_t* src = v;
  uint64_t* dst = tmp;
  for (int pass = 0; pass < passes; ++pass) {
    uint32_t* c = count[pass];
    const int shift = 32 + pass * digit;
    if (c[(src[0] >> shift) & mask] == m) continue;  // one digit value: nothing moves
    uint32_t sum = 0;
    for (int64_t b = 0; b < buckets; ++b) sum += std::exchange(c[b], sum);
    for (int64_t p = 0; p < m; ++p) dst[c[(src[p] >> shift) & mask]++] = src[p];
    std::swap(src, dst);
  }
  if (src != v) std::memcpy(v, src, m * sizeof(uint64_t));
}

// Numbers the distinct keys of entries sorted by key: key(p) and entry(p) give the
// row (minus lo) and local entry at sorted position p.
template <typename KeyFn, typename EntryFn>
void NumberSortedRows(const KeyFn& key, const EntryFn& entry, RowClusters::Cluster* c) {
  for (int64_t p = 0; p < c->num_entries(); ++p) {
    if (p == 0 || key(p) != key(p - 1)) {
      c->rows.push_back(c->lo + static_cast<int64_t>(key(p)));
    }
    c->inverse[entry(p)] = static_cast<uint32_t>(c->rows.size() - 1);
  }
}

// Writes make(row - lo, local entry) for each entry of a cluster to v; false on a bad id.
template <typename S, typename V, typename MakeFn>
bool KeyEntries(const std::vector<S>& sites, const RowClusters::Cluster& c, V* v,
                const MakeFn& make) {
  for (size_t k = 0; k < c.sites.size(); ++k) {
    const S& s = sites[c.sites[k]];
    const uint64_t shift = static_cast<uint64_t>(s.offset - c.lo);
    const int64_t first = c.site_begin[k];
    for (int64_t j = 0; j < s.n; ++j) {
      if (!s.Valid(s.ids[j])) return false;
      v[first + j] = make(static_cast<uint64_t>(s.ids[j]) + shift,
                          static_cast<uint32_t>(first + j));
    }
  }
  return true;
}

// Groups a cluster by sorting its entries by row: for wide clusters (large
// vocabularies). False on a bad id.
template <typename S>
bool GroupSorted(const std::vector<S>& sites, RowClusters::Cluster* c) {
  const int64_t m = c->num_entries();
  int bits = 0;
  while (bits < 64 && (static_cast<uint64_t>(c->hi - c->lo - 1) >> bits)) ++bits;
  if (bits <= 32) {
    // (row - lo) << 32 | local entry: sorting by the high half sorts by (row, entry).
    std::unique_ptr<uint64_t[]> buffer(new uint64_t[2 * m]);
    uint64_t* v = buffer.get();
    if (!KeyEntries(sites, *c, v, [](uint64_t key, uint32_t e) { return key << 32 | e; })) {
      return false;
    }
    SortByKey(v, v + m, m, bits);
    NumberSortedRows([v](int64_t p) { return v[p] >> 32; },
                     [v](int64_t p) { return static_cast<uint32_t>(v[p]); }, c);
  } else {  // vocabularies beyond 2^32 rows: (row - lo, entry) pairs
    std::vector<std::pair<uint64_t, uint32_t>> v(m);
    if (!KeyEntries(sites, *c, v.data(), [](uint64_t key, uint32_t e) {
          return std::make_pair(key, e);
        })) {
      return false;
    }
    std::sort(v.begin(), v.end());
    NumberSortedRows([&v](int64_t p) { return v[p].first; },
                     [&v](int64_t p) { return v[p].second; }, c);
  }
  return true;
}

// One table's sites to group by row, and where its clusters go (GroupTablesByRow).
template <typename S>
struct SitesOfTable {
  const PackedLayout* layout;
  const std::vector<S>* sites;
  RowClusters* out;
};

// Forms the clusters of a table's sites (see RowClusters), not yet grouped.
template <typename S>
void FormClusters(const std::vector<S>& sites, RowClusters* out) {
  const int num_sites = static_cast<int>(sites.size());
  std::vector<int> by_offset(num_sites);
  std::iota(by_offset.begin(), by_offset.end(), 0);
  std::sort(by_offset.begin(), by_offset.end(), [&](int a, int b) {
    return std::make_pair(sites[a].offset, a) < std::make_pair(sites[b].offset, b);
  });
  auto& clusters = out->clusters;
  for (int i : by_offset) {
    const int64_t lo = sites[i].offset, hi = lo + sites[i].vocab;
    if (clusters.empty() || lo >= clusters.back().hi) {
      clusters.emplace_back();
      clusters.back().lo = lo;
    }
    clusters.back().hi = std::max(clusters.back().hi, hi);
    clusters.back().sites.push_back(i);
  }
  for (auto& c : clusters) {
    std::sort(c.sites.begin(), c.sites.end());
    c.site_begin.push_back(0);
    for (int i : c.sites) c.site_begin.push_back(c.site_begin.back() + sites[i].n);
    c.inverse.reset(new uint32_t[c.num_entries()]);
  }
}

// Groups the entries of each table's sites by packed row (see RowClusters), the
// clusters of all the tables in one pass over the worker threads: a kernel over many
// one-hot features has as many tables of one cluster each, which grouped table by table
// would leave all threads but one idle. A cluster grouped densely is handed to
// group_dense(table, cluster index, cluster), which groups it and returns false on a bad
// id. On bad ids the error names the first of the first table that has one.
template <typename S, typename DenseFn>
Status GroupTablesByRow(OpKernelContext* ctx, const char* op,
                        const std::vector<SitesOfTable<S>>& tables, const DenseFn& group_dense) {
  struct Item {
    int table;
    int cluster;
    int64_t entries;
  };
  std::vector<Item> items;
  int64_t total = 0;
  for (size_t t = 0; t < tables.size(); ++t) {
    FormClusters(*tables[t].sites, tables[t].out);
    const auto& clusters = tables[t].out->clusters;
    for (size_t k = 0; k < clusters.size(); ++k) {
      items.push_back({static_cast<int>(t), static_cast<int>(k), clusters[k].num_entries()});
      total += clusters[k].num_entries();
    }
  }
  // Largest clusters first, so that the last items to be claimed are small ones.
  std::stable_sort(items.begin(), items.end(),
                   [](const Item& a, const Item& b) { return a.entries > b.entries; });
  std::unique_ptr<std::atomic<bool>[]> bad_id(new std::atomic<bool>[tables.size()]());
  RunWorkItems(ctx, items.size(), total >= kMinParallelEntries, [&](int64_t k) {
    const Item& item = items[k];
    RowClusters::Cluster* c = &tables[item.table].out->clusters[item.cluster];
    const int64_t width = c->hi - c->lo;
    const bool dense = width <= kDenseRowsPerEntry * c->num_entries() + kDenseMinRows;
    if (!(dense ? group_dense(item.table, item.cluster, c)
                : GroupSorted(*tables[item.table].sites, c))) {
      bad_id[item.table].store(true);
    }
  });
  for (size_t t = 0; t < tables.size(); ++t) {
    if (bad_id[t].load()) return FirstBadId(op, *tables[t].layout, *tables[t].sites);
  }
  for (const SitesOfTable<S>& table : tables) {
    for (auto& c : table.out->clusters) {
      c.unique_begin = table.out->num_unique;
      table.out->num_unique += c.num_unique();
    }
  }
  return OkStatus();
}

// GroupTablesByRow of each table's sites, each cluster grouped densely by GroupDense.
template <typename S>
Status GroupTablesByRow(OpKernelContext* ctx, const char* op,
                        const std::vector<SitesOfTable<S>>& tables) {
  return GroupTablesByRow(ctx, op, tables, [&](int t, int64_t, RowClusters::Cluster* c) {
    return GroupDense(*tables[t].sites, c);
  });
}

// GroupTablesByRow of one table's sites.
template <typename S>
Status GroupByRow(OpKernelContext* ctx, const char* op, const PackedLayout& layout,
                  const std::vector<S>& sites, RowClusters* out) {
  return GroupTablesByRow<S>(ctx, op, {{&layout, &sites, out}});
}

// ---------------------------------------------------------------------------------
// Pooled sites: segment indexes and scales.

// Where a pooled site's segments find their entries: those of segment s are
// perm[start[s]], ..., perm[start[s + 1] - 1]; perm is null (the identity) when the
// segment ids are sorted, the usual case for ids from a SparseTensor.
struct SegmentIndex {
  int64_t* start = nullptr;
  int32_t* perm = nullptr;
};

// Builds a pooled site's segment index in start[0, S] and, for unsorted segment ids,
// perm_buffer[0, n) (a stable counting sort: a segment's entries keep their order).
// False if a segment id is out of range.
template <typename T, typename Tid>
bool IndexSegments(const Site<T, Tid>& s, int64_t* start, int32_t* perm_buffer,
                   SegmentIndex* index) {
  const int64_t num_segments = s.num_segments;
  const int64_t* segments = s.segments;
  index->start = start;
  if (!segments) {  // pooled by row: segment k holds entries [k * L, (k + 1) * L)
    for (int64_t k = 0; k <= num_segments; ++k) start[k] = k * s.row_length;
    return true;
  }
  // Sorted segment ids: note where each segment begins.
  int64_t next = 0;  // the first segment whose start is not yet known
  int64_t j = 0;
  for (; j < s.n; ++j) {
    const int64_t seg = segments[j];
    if (static_cast<uint64_t>(seg) >= static_cast<uint64_t>(num_segments)) return false;
    if (seg + 1 < next) break;  // below the previous segment id: unsorted
    while (next <= seg) start[next++] = j;
  }
  if (j == s.n) {
    while (next <= num_segments) start[next++] = s.n;
    return true;
  }
  // Unsorted: count the ids of each segment, then place them.
  std::fill(start, start + num_segments + 1, 0);
  for (j = 0; j < s.n; ++j) {
    const int64_t seg = segments[j];
    if (static_cast<uint64_t>(seg) >= static_cast<uint64_t>(num_segments)) return false;
    ++start[seg + 1];
  }
  for (int64_t k = 1; k <= num_segments; ++k) start[k] += start[k - 1];
  for (j = 0; j < s.n; ++j) perm_buffer[start[segments[j]]++] = j;
  // Each start[k] has advanced to the end of segment k: shift them back by one.
  for (int64_t k = num_segments; k > 0; --k) start[k] = start[k - 1];
  start[0] = 0;
  index->perm = perm_buffer;
  return true;
}

// The segment indexes of every pooled site of a call (see IndexSegments), in two
// buffers shared by the sites; unpooled sites have an empty index.
struct PooledIndexes {
  std::vector<SegmentIndex> index;
  std::unique_ptr<int64_t[]> starts;
  std::unique_ptr<int32_t[]> perms;

  template <typename T, typename Tid>
  Status Build(OpKernelContext* ctx, const char* op, const PackedLayout& layout,
               const std::vector<Site<T, Tid>>& sites) {
    const int num_sites = static_cast<int>(sites.size());
    std::vector<int> pooled_sites;
    int64_t starts_size = 0, perms_size = 0;
    for (int i = 0; i < num_sites; ++i) {
      if (!sites[i].pooled) continue;
      pooled_sites.push_back(i);
      starts_size += sites[i].num_segments + 1;
      perms_size += sites[i].n;
    }
    starts.reset(new int64_t[starts_size]);
    perms.reset(new int32_t[perms_size]);
    std::vector<int64_t*> site_start(num_sites);
    std::vector<int32_t*> site_perm(num_sites);
    int64_t* next_start = starts.get();
    int32_t* next_perm = perms.get();
    for (int i : pooled_sites) {
      site_start[i] = next_start;
      site_perm[i] = next_perm;
      next_start += sites[i].num_segments + 1;
      next_perm += sites[i].n;
    }
    index.assign(num_sites, SegmentIndex());
    std::atomic<bool> bad_segment(false);
    RunWorkItems(ctx, pooled_sites.size(), starts_size + perms_size >= kMinParallelEntries,
                 [&](int64_t k) {
                   const int i = pooled_sites[k];
                   if (!IndexSegments(sites[i], site_start[i], site_perm[i], &index[i])) {
                     bad_segment.store(true);
                   }
                 });
    if (bad_segment.load()) return FirstBadSegment(op, layout, sites);
    return OkStatus();
  }
};

// The address of packed row `offset + id`, computed without forming a pointer (the id
// may be out of range when only prefetched).
template <typename T, typename Tid>
const void* RowAddress(const T* base, Tid id, int64_t d) {
  return reinterpret_cast<const void*>(reinterpret_cast<uintptr_t>(base) +
                                       static_cast<int64_t>(id) * d * sizeof(T));
}

// Checks a pooled site's segment ids and, for mean and sqrtn, writes each segment's
// scale 1 / sum(w) or 1 / sqrt(sum(w^2)) (0 where the sum is 0, like div_no_nan),
// summing in the same order as the forward pass. False on a bad segment id.
template <typename T, typename Tid>
bool SegmentScales(const Site<T, Tid>& s, T* scale) {
  if (!scale && !s.segments) return true;  // pooled by row: nothing to check
  if (scale) std::fill(scale, scale + s.num_segments, T(0));
  for (int64_t j = 0, row = 0; j < s.n; ++j) {
    if (!s.segments && j == (row + 1) * s.row_length) ++row;  // pooled by row
    const int64_t seg = s.segments ? s.segments[j] : row;
    if (static_cast<uint64_t>(seg) >= static_cast<uint64_t>(s.num_segments)) return false;
    if (scale) {
      const T w = s.weights ? s.weights[j] : T(1);
      scale[seg] += s.combiner == Combiner::kSqrtN ? w * w : w;
    }
  }
  for (int64_t k = 0; scale && k < s.num_segments; ++k) {
    const T denominator = s.combiner == Combiner::kMean ? scale[k] : std::sqrt(scale[k]);
    scale[k] = denominator == 0 ? T(0) : T(1) / denominator;
  }
  return true;
}

// ---------------------------------------------------------------------------------
// Stitched ops: where their sites lie.

// Where the sites of a stitched op lie in its [rows, width] output (or gradient):
// site i fills columns [columns[i], columns[i] + row_blocks[i] * D_i), with
// row_blocks[i] consecutive rows of its own output in each row.
struct StitchLayout {
  std::vector<int64_t> columns;
  std::vector<int64_t> row_blocks;

  Status Init(OpKernelConstruction* c, int num_sites) {
    TF_RETURN_IF_ERROR(c->GetAttr("columns", &columns));
    TF_RETURN_IF_ERROR(c->GetAttr("row_blocks", &row_blocks));
    if (columns.size() != num_sites || row_blocks.size() != num_sites) {
      return errors::InvalidArgument(c->def().op(), ": columns and row_blocks need one entry ",
                                     "per site (", num_sites, "); got ", columns.size(),
                                     " and ", row_blocks.size());
    }
    for (int i = 0; i < num_sites; ++i) {
      if (columns[i] < 0 || row_blocks[i] < 1) {
        return errors::InvalidArgument(c->def().op(), ": site ", i, " needs column >= 0 and ",
                                       "row_blocks >= 1; got ", columns[i], " and ",
                                       row_blocks[i]);
      }
    }
    return OkStatus();
  }

  // The place of site i (output rows of width d) in a [rows, width] tensor at base,
  // after checking that it fits.
  template <typename P, typename T, typename Tid>
  Status Place(const char* op, const PackedLayout& layout, int i, const Site<T, Tid>& s,
               int64_t rows, int64_t width, int64_t d, P* base, RowPlace<P>* place) const {
    TF_RETURN_IF_ERROR(Check(op, layout, i, s, rows, width, d));
    *place = {base + columns[i], row_blocks[i], width, d};
    return OkStatus();
  }

  // Checks that site i (output rows of width d) fits a [rows, width] tensor.
  template <typename T, typename Tid>
  Status Check(const char* op, const PackedLayout& layout, int i, const Site<T, Tid>& s,
               int64_t rows, int64_t width, int64_t d) const {
    if (s.out_rows() != rows * row_blocks[i] || columns[i] + row_blocks[i] * d > width) {
      return errors::InvalidArgument(
          op, ": ", layout.Feature(i), " has ", s.out_rows(), " output rows of width ", d,
          ", which do not fill ", row_blocks[i], " row(s) per row of the stitched [", rows,
          ", ", width, "] tensor from column ", columns[i]);
    }
    return OkStatus();
  }
};

// The sites of a multi-table op (site i reads tables[table_index[i]]) by table: the
// op's indices of each table's sites, and their layout.
struct TableSites {
  std::vector<std::vector<int>> sites;
  std::vector<PackedLayout> layouts;

  Status Init(const char* op, const PackedLayout& layout, const std::vector<int64_t>& table_index,
              int64_t num_tables) {
    sites.assign(num_tables, {});
    for (int i = 0; i < layout.size(); ++i) {
      if (table_index[i] < 0 || table_index[i] >= num_tables) {
        return errors::InvalidArgument(op, ": table_index ", table_index[i], " outside [0, ",
                                       num_tables, ")");
      }
      sites[table_index[i]].push_back(i);
    }
    layouts.clear();
    for (const auto& table : sites) layouts.push_back(layout.Subset(table));
    return OkStatus();
  }
};

// Per site, its table's values and row width, after checking that the table is a
// matrix holding the site's rows. Exchanged sites (PackedLayout::exchanged) index a
// table of fetched rows: their ids are bounded by its rows instead.
template <typename T, typename Tables, typename S>
Status SiteTables(const char* op, const PackedLayout& layout,
                  const std::vector<int64_t>& table_index, const Tables& tables,
                  std::vector<S>* sites, std::vector<const T*>* values,
                  std::vector<int64_t>* dims) {
  for (int i = 0; i < layout.size(); ++i) {
    const Tensor& table = tables[table_index[i]];
    if (!TensorShapeUtils::IsMatrix(table.shape())) {
      return errors::InvalidArgument(op, ": tables must be matrices; got ",
                                     table.shape().DebugString());
    }
    if (layout.exchanged) {
      (*sites)[i].vocab = std::min<int64_t>(
          (*sites)[i].vocab, std::max<int64_t>(0, table.dim_size(0) - layout.offsets[i]));
    } else if (layout.end_row(i) > table.dim_size(0)) {
      return errors::InvalidArgument(op, ": ", layout.Feature(i), " occupies rows [",
                                     layout.offsets[i], ", ", layout.end_row(i),
                                     ") of table ", table_index[i], " of the op, which has ",
                                     table.dim_size(0), " rows");
    }
    values->push_back(table.flat<T>().data());
    dims->push_back(table.dim_size(1));
  }
  return OkStatus();
}

}  // namespace
}  // namespace tensorflow

#endif  // PICASSO_TF_CUSTOM_OPS_PACKED_SITES_H_
