// Fused embedding lookups on a packed table (CPU kernels).
//
// A packed table stacks several features' embedding tables by rows: site i (the ids
// of one feature) reads rows [offsets[i], offsets[i] + vocab_sizes[i]), so packed row
// = id + offset. One op call serves every site of the table.
//
//   PicassoPackedUnique      the ids of all sites -> their packed rows deduplicated in
//                            ascending order, each id's index into them, and how often
//                            each row occurs.
//   PicassoPackedLookup      gathers every site's rows in one kernel; pooled sites
//                            (combiner sum, mean or sqrtn, optional weights) combine
//                            them per segment like tf.nn.embedding_lookup_sparse. Each
//                            output row is written once, directly from the table.
//   PicassoPackedLookupGrad  the table gradient of PicassoPackedLookup, row-sparse:
//                            ascending unique rows and one summed gradient row each,
//                            bit-identical whatever the number of threads.
//   PicassoStitchedLookup    the lookups of several packed tables written straight
//                            into the columns of one [rows, width] tensor: the
//                            model's concatenation of their outputs, without the copy
//                            (and without the split of its gradient).
//   PicassoStitchedLookupGrad  the tables' gradients, reading the sites' columns of
//                            the stitched gradient in place.
//
// Work is cut into items of similar cost that the intra-op threads claim one at a
// time (picasso_common.h). Ids are checked inside the hot loops; when one is bad, a
// sequential re-scan finds the first bad value in input order for the error message.

#define EIGEN_USE_THREADS  // before any Eigen header: variable updates run on the CPU device

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "picasso_common.h"
#include "sparse_updates.h"
#include "tensorflow/core/framework/op.h"
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
using ::picasso::RunWorkItems;
using ::picasso::ScaleRow;
using shape_inference::DimensionHandle;
using shape_inference::InferenceContext;
using shape_inference::ShapeHandle;

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
// The row loops prefetch rows about kPrefetchBytes ahead, but 8 to 32 rows (measured
// on AMD EPYC, widths 8 to 64 floats).
constexpr int64_t kPrefetchBytes = 2048;
// Stitched tensors are walked in blocks of rows spanning about this many bytes.
constexpr int64_t kBlockBytes = 256 << 10;

constexpr int64_t PrefetchDistance(int64_t row_bytes) {
  return std::clamp<int64_t>(kPrefetchBytes / std::max<int64_t>(row_bytes, 1), 8, 32);
}

constexpr char kUniqueOp[] = "PicassoPackedUnique";
constexpr char kLookupOp[] = "PicassoPackedLookup";
constexpr char kGradOp[] = "PicassoPackedLookupGrad";
constexpr char kStitchedOp[] = "PicassoStitchedLookup";
constexpr char kStitchedGradOp[] = "PicassoStitchedLookupGrad";
constexpr char kProjectionOp[] = "PicassoStitchedProjection";
constexpr char kProjectionGradOp[] = "PicassoStitchedProjectionGrad";
constexpr char kProjectionGradApplyOp[] = "PicassoStitchedProjectionGradApply";

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

  Status Init(OpKernelConstruction* c, bool with_combiners) {
    int n;
    TF_RETURN_IF_ERROR(c->GetAttr("N", &n));
    TF_RETURN_IF_ERROR(c->GetAttr("offsets", &offsets));
    TF_RETURN_IF_ERROR(c->GetAttr("vocab_sizes", &vocab_sizes));
    TF_RETURN_IF_ERROR(c->GetAttr("feature_names", &names));
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
  bool pooled = false;                // combiner != "none"
  const int64_t* segments = nullptr;  // pooled sites: the output row of each id
  int64_t num_segments = 0;
  const T* weights = nullptr;  // null: every weight is 1

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
    for (int64_t j = 0; s.pooled && j < s.n; ++j) {
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

// Reads the per-site inputs of PicassoPackedLookup and its gradient, checking shapes.
// A site's output: [num_segments, D] when pooled, else ids.shape + [D].
template <typename T, typename Tid>
TensorShape OutputShape(const Site<T, Tid>& s, const Tensor& ids, int64_t d) {
  if (s.pooled) return TensorShape({s.num_segments, d});
  TensorShape shape = ids.shape();
  shape.AddDim(d);
  return shape;
}

template <typename T, typename Tid>
Status ReadSites(OpKernelContext* ctx, const char* op, const PackedLayout& layout,
                 std::vector<Site<T, Tid>>* sites) {
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
    // Unpooled ids may have any shape (the output is ids.shape + [D]); pooled ids are flat.
    if ((combiner != Combiner::kNone && !TensorShapeUtils::IsVector(ids[i].shape())) ||
        !TensorShapeUtils::IsVector(segments[i].shape()) ||
        !TensorShapeUtils::IsVector(weights[i].shape())) {
      return errors::InvalidArgument(
          op, ": ids (when pooled), segment_ids and weights of ", layout.Feature(i),
          " must be vectors; got shapes ", ids[i].shape().DebugString(), ", ",
          segments[i].shape().DebugString(), " and ", weights[i].shape().DebugString());
    }
    s.ids = ids[i].flat<Tid>().data();
    s.n = ids[i].NumElements();
    s.offset = layout.offsets[i];
    s.vocab = layout.vocab_sizes[i];
    s.combiner = combiner;
    s.pooled = combiner != Combiner::kNone;
    if (s.pooled) {
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

// Item size in bytes for `total_bytes` bytes of rows spread over the threads.
int64_t TargetItemBytes(OpKernelContext* ctx, int64_t total_bytes) {
  return std::max<int64_t>(kMinItemBytes, total_bytes / (NumThreads(ctx) * kItemsPerThread));
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

// Groups a cluster by marking its rows in a byte map over [lo, hi) and numbering the
// marked ones in order: for clusters not much wider than their number of entries.
// False on a bad id.
template <typename S>
bool GroupDense(const std::vector<S>& sites, RowClusters::Cluster* c) {
  const int64_t padded = (c->hi - c->lo + 63) / 64 * 64;
  std::unique_ptr<uint8_t[]> seen(new uint8_t[padded]());
  for (int i : c->sites) {
    // Locals, which the byte stores cannot alias, so they stay in registers.
    uint8_t* site_seen = seen.get() + (sites[i].offset - c->lo);
    const auto* ids = sites[i].ids;
    const int64_t n = sites[i].n, vocab = sites[i].vocab;
    for (int64_t j = 0; j < n; ++j) {
      if (!InRange(ids[j], vocab)) return false;
      site_seen[ids[j]] = 1;
    }
  }
  // Number the marked rows 64 at a time: pack their marks into a bit mask (one
  // multiplication turns 8 little-endian 0/1 bytes into 8 bits), then visit its bits.
  std::unique_ptr<uint32_t[]> rank(new uint32_t[padded]);
  for (int64_t k = 0; k < padded; k += 64) {
    uint64_t mask = 0;
    for (int b = 0; b < 64; b += 8) {
      uint64_t bytes;
      std::memcpy(&bytes, seen.get() + k + b, 8);
      mask |= ((bytes * 0x0102040810204080ull) >> 56) << b;
    }
    for (; mask != 0; mask &= mask - 1) {
      const int64_t row = k + __builtin_ctzll(mask);
      rank[row] = static_cast<uint32_t>(c->rows.size());
      c->rows.push_back(c->lo + row);
    }
  }
  for (size_t k = 0; k < c->sites.size(); ++k) {
    const S& s = sites[c->sites[k]];
    const uint32_t* site_rank = rank.get() + (s.offset - c->lo);
    uint32_t* inverse = c->inverse.get() + c->site_begin[k];
    for (int64_t j = 0; j < s.n; ++j) inverse[j] = site_rank[s.ids[j]];
  }
  return true;
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

// Groups the entries of all sites by packed row (see RowClusters).
template <typename S>
Status GroupByRow(OpKernelContext* ctx, const char* op, const PackedLayout& layout,
                  const std::vector<S>& sites, RowClusters* out) {
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
  int64_t total = 0;
  for (auto& c : clusters) {
    std::sort(c.sites.begin(), c.sites.end());
    c.site_begin.push_back(0);
    for (int i : c.sites) c.site_begin.push_back(c.site_begin.back() + sites[i].n);
    c.inverse.reset(new uint32_t[c.num_entries()]);
    total += c.num_entries();
  }
  // Largest clusters first, so that the last items to be claimed are small ones.
  std::vector<int> schedule(clusters.size());
  std::iota(schedule.begin(), schedule.end(), 0);
  std::stable_sort(schedule.begin(), schedule.end(), [&](int a, int b) {
    return clusters[a].num_entries() > clusters[b].num_entries();
  });
  std::atomic<bool> bad_id(false);
  RunWorkItems(ctx, schedule.size(), total >= kMinParallelEntries, [&](int64_t k) {
    RowClusters::Cluster* c = &clusters[schedule[k]];
    const int64_t width = c->hi - c->lo;
    const bool dense = width <= kDenseRowsPerEntry * c->num_entries() + kDenseMinRows;
    if (!(dense ? GroupDense(sites, c) : GroupSorted(sites, c))) bad_id.store(true);
  });
  if (bad_id.load()) return FirstBadId(op, layout, sites);
  for (auto& c : clusters) {
    c.unique_begin = out->num_unique;
    out->num_unique += c.num_unique();
  }
  return OkStatus();
}

// ---------------------------------------------------------------------------------
// PicassoPackedUnique

template <typename Tid>
class PackedUniqueOp : public OpKernel {
 public:
  explicit PackedUniqueOp(OpKernelConstruction* c) : OpKernel(c) {
    OP_REQUIRES_OK(c, layout_.Init(c, /*with_combiners=*/false));
  }

  void Compute(OpKernelContext* ctx) override {
    OpInputList ids;
    OP_REQUIRES_OK(ctx, ctx->input_list("ids", &ids));
    std::vector<SiteIds<Tid>> sites(layout_.size());
    int64_t total = 0;
    for (int i = 0; i < layout_.size(); ++i) {
      sites[i] = {ids[i].flat<Tid>().data(), ids[i].NumElements(), layout_.offsets[i],
                  layout_.vocab_sizes[i]};
      total += sites[i].n;
    }
    OP_REQUIRES(ctx, total <= INT32_MAX,
                errors::InvalidArgument(kUniqueOp, ": at most 2^31 - 1 ids per call; got ",
                                        total));
    RowClusters groups;
    OP_REQUIRES_OK(ctx, GroupByRow(ctx, kUniqueOp, layout_, sites, &groups));

    Tensor *unique_rows, *counts;
    const TensorShape unique_shape({groups.num_unique});
    OP_REQUIRES_OK(ctx, ctx->allocate_output("unique_rows", unique_shape, &unique_rows));
    OP_REQUIRES_OK(ctx, ctx->allocate_output("counts", unique_shape, &counts));
    OpOutputList inverse_list;
    OP_REQUIRES_OK(ctx, ctx->output_list("inverse", &inverse_list));
    std::vector<int32_t*> inverse(layout_.size());
    for (int i = 0; i < layout_.size(); ++i) {
      Tensor* t;
      OP_REQUIRES_OK(ctx, inverse_list.allocate(i, ids[i].shape(), &t));
      inverse[i] = t->flat<int32_t>().data();
    }
    int64_t* rows = unique_rows->flat<int64_t>().data();
    int32_t* count = counts->flat<int32_t>().data();
    RunWorkItems(ctx, groups.clusters.size(), total >= kMinParallelEntries, [&](int64_t k) {
      const RowClusters::Cluster& c = groups.clusters[k];
      std::copy(c.rows.begin(), c.rows.end(), rows + c.unique_begin);
      std::fill(count + c.unique_begin, count + c.unique_begin + c.num_unique(), 0);
      for (size_t site = 0; site < c.sites.size(); ++site) {
        int32_t* site_inverse = inverse[c.sites[site]];
        const uint32_t* local = c.inverse.get() + c.site_begin[site];
        for (int64_t j = 0; j < c.site_begin[site + 1] - c.site_begin[site]; ++j) {
          site_inverse[j] = static_cast<int32_t>(c.unique_begin + local[j]);
          ++count[site_inverse[j]];
        }
      }
    });
  }

 private:
  PackedLayout layout_;
};

// ---------------------------------------------------------------------------------
// PicassoPackedLookup

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

// out(j) = w_j * table[offset + ids[j]] for j in [begin, end); false on a bad id.
// (The site is passed by value, here and below: stores to rows cannot alias a local,
// so its fields stay in registers.)
template <int64_t kD, typename T, typename Tid>
bool GatherRows(const Site<T, Tid> s, const T* table, int64_t d, int64_t begin,
                int64_t end, const RowPlace<T> out) {
  const int64_t width = kD ? kD : d;
  const T* base = table + s.offset * width;
  const int64_t row_bytes = width * sizeof(T);
  const int64_t ahead = PrefetchDistance(row_bytes);
  for (int64_t j = begin; j < end; ++j) {
    if (j + ahead < end) {
      PrefetchBytes(RowAddress(base, s.ids[j + ahead], width), row_bytes);
    }
    const Tid id = s.ids[j];
    if (!s.Valid(id)) return false;
    const T* src = base + static_cast<int64_t>(id) * width;
    if (s.weights) {
      ScaleRow<kD>(out(j), src, s.weights[j], d);
    } else {
      CopyRow<kD>(out(j), src, d);
    }
  }
  return true;
}

// Writes the pooled output rows of segments [begin, end); false on a bad id.
template <int64_t kD, typename T, typename Tid>
bool PoolSegments(const Site<T, Tid> s, const SegmentIndex index, const T* table,
                  int64_t d, int64_t begin, int64_t end, const RowPlace<T> out) {
  const int64_t width = kD ? kD : d;
  const T* base = table + s.offset * width;
  const int64_t row_bytes = width * sizeof(T);
  const int64_t ahead = PrefetchDistance(row_bytes);
  const int64_t p_end = index.start[end];
  auto entry = [&index](int64_t p) -> int64_t { return index.perm ? index.perm[p] : p; };
  for (int64_t seg = begin; seg < end; ++seg) {
    T* dst = out(seg);
    const int64_t first = index.start[seg], last = index.start[seg + 1];
    if (first == last) {
      std::fill(dst, dst + width, T(0));
      continue;
    }
    T weight_sum = 0;  // sum of w (mean) or of w^2 (sqrtn)
    for (int64_t p = first; p < last; ++p) {
      if (p + ahead < p_end) {
        PrefetchBytes(RowAddress(base, s.ids[entry(p + ahead)], width), row_bytes);
      }
      const int64_t j = entry(p);
      const Tid id = s.ids[j];
      if (!s.Valid(id)) return false;
      const T* src = base + static_cast<int64_t>(id) * width;
      const T w = s.weights ? s.weights[j] : T(1);
      if (p == first) {
        ScaleRow<kD>(dst, src, w, d);
      } else {
        AxpyRow<kD>(dst, src, w, d);
      }
      weight_sum += s.combiner == Combiner::kSqrtN ? w * w : w;
    }
    if (s.combiner == Combiner::kMean || s.combiner == Combiner::kSqrtN) {
      // Like TF's div_no_nan: a zero denominator gives a zero row.
      const T denominator =
          s.combiner == Combiner::kMean ? weight_sum : std::sqrt(weight_sum);
      for (int64_t k = 0; k < width; ++k) {
        dst[k] = denominator == 0 ? T(0) : dst[k] / denominator;
      }
    }
  }
  return true;
}

// Rows of a stitched [rows, width] tensor that a work item covers together: enough
// to keep the pages and cache lines it touches resident while every site visits them.
int64_t RowsPerBlock(int64_t row_bytes) {
  return std::clamp<int64_t>(kBlockBytes / std::max<int64_t>(row_bytes, 1), 1, 4096);
}

// An unpooled site of a stitched lookup, as the row-by-row loop reads it.
template <typename T, typename Tid>
struct StitchedColumn {
  const Tid* ids;
  const T* rows;     // the table's row `offset`: id x reads rows + x * d
  const T* weights;  // null: all 1
  RowPlace<T> out;
  int64_t vocab;
  int64_t d;
};

// Fills stitched output rows [r0, r1) from unpooled sites, one output row at a time,
// left to right, so that the stores are sequential. Two prefetch streams run ahead:
// the ids of each column a few rows down (every column's ids are a separate array,
// too many streams for the hardware prefetcher), and the table rows that the columns
// a few places to the right read. False on a bad id.
template <typename T, typename Tid>
bool FillStitchedRows(const std::vector<StitchedColumn<T, Tid>>& columns, int64_t r0,
                      int64_t r1) {
  constexpr int kRowsAhead = 8;
  const int n = static_cast<int>(columns.size());
  const int ahead = std::min(8, n - 1);  // columns
  for (int64_t r = r0; r < r1; ++r) {
    int a = ahead;               // the column whose table row is prefetched
    int64_t a_row = r;
    for (int c = 0; c < n; ++c) {
      const StitchedColumn<T, Tid>& col = columns[c];
      const int64_t k = col.out.per_row;
      PrefetchBytes(col.ids + (r + kRowsAhead) * k, k * sizeof(Tid));
      if (a_row < r1) {
        const StitchedColumn<T, Tid>& next = columns[a];
        PrefetchBytes(RowAddress(next.rows, next.ids[a_row * next.out.per_row], next.d),
                      next.d * sizeof(T));
      }
      if (++a == n) {
        a = 0;
        ++a_row;
      }
      for (int64_t j = r * k; j < (r + 1) * k; ++j) {
        const Tid id = col.ids[j];
        if (!InRange(id, col.vocab)) return false;
        const T* src = col.rows + static_cast<int64_t>(id) * col.d;
        T* dst = col.out(j);
        DispatchDim(col.d, [&](auto dim) {
          constexpr int64_t kD = decltype(dim)::value;
          if (col.weights) {
            ScaleRow<kD>(dst, src, col.weights[j], col.d);
          } else {
            CopyRow<kD>(dst, src, col.d);
          }
        });
      }
    }
  }
  return true;
}

// Looks up every site: site i reads rows of width dims[i] from tables[i] and writes
// its output rows to places[i]. With stitched_rows >= 0 (a stitched output of that
// many rows), work items are blocks of output rows: the unpooled sites fill them
// row by row (FillStitchedRows), then each pooled site its columns of the block.
template <typename T, typename Tid>
Status RunLookup(OpKernelContext* ctx, const char* op, const PackedLayout& layout,
                 const std::vector<Site<T, Tid>>& sites, const std::vector<const T*>& tables,
                 const std::vector<int64_t>& dims, const std::vector<RowPlace<T>>& places,
                 int64_t stitched_rows = -1) {
  const int num_sites = layout.size();
  PooledIndexes pooled;
  TF_RETURN_IF_ERROR(pooled.Build(ctx, op, layout, sites));
  const std::vector<SegmentIndex>& index = pooled.index;

  // Items: ranges of ids (unpooled sites) or of segments (pooled sites, costed by
  // their ids plus their output rows), of similar cost in bytes.
  std::vector<int64_t> row_bytes(num_sites);
  int64_t total_bytes = 0;
  for (int i = 0; i < num_sites; ++i) {
    const auto& s = sites[i];
    row_bytes[i] = std::max<int64_t>(1, dims[i] * sizeof(T));
    total_bytes += (s.n + (s.pooled ? s.num_segments : 0)) * row_bytes[i];
  }
  const int64_t target_bytes = TargetItemBytes(ctx, total_bytes);
  std::vector<WorkItem> items;
  std::vector<StitchedColumn<T, Tid>> columns;
  std::vector<int> pooled_columns;
  if (stitched_rows >= 0) {
    for (int i = 0; i < num_sites; ++i) {
      const Site<T, Tid>& s = sites[i];
      if (s.pooled) {
        pooled_columns.push_back(i);
      } else {
        columns.push_back({s.ids, tables[i] + s.offset * dims[i], s.weights, places[i], s.vocab,
                           dims[i]});
      }
    }
    const int64_t block = RowsPerBlock(places[0].stride * sizeof(T));
    for (int64_t r = 0; r < stitched_rows; r += block) {
      items.push_back({-1, r, std::min(stitched_rows, r + block)});
    }
  }
  for (int i = 0; i < num_sites && stitched_rows < 0; ++i) {
    const int64_t target = std::max<int64_t>(1, target_bytes / row_bytes[i]);
    if (sites[i].pooled) {
      const int64_t* start = index[i].start;
      SplitWork(i, sites[i].num_segments, target,
                [start](int64_t s) { return start[s] + s; }, &items);
    } else {
      SplitWork(i, sites[i].n, target, [](int64_t j) { return j; }, &items);
    }
  }
  // Entries (or segments) [begin, end) of site i.
  auto run = [&](int i, int64_t begin, int64_t end) {
    const Site<T, Tid>& s = sites[i];
    return DispatchDim(dims[i], [&](auto dim) {
      constexpr int64_t kD = decltype(dim)::value;
      return s.pooled ? PoolSegments<kD>(s, index[i], tables[i], dims[i], begin, end, places[i])
                      : GatherRows<kD>(s, tables[i], dims[i], begin, end, places[i]);
    });
  };
  std::atomic<bool> bad_id(false);
  RunWorkItems(ctx, items.size(), total_bytes >= kMinParallelBytes, [&](int64_t k) {
    const WorkItem& item = items[k];
    bool ok = true;
    if (item.unit >= 0) {
      ok = run(item.unit, item.begin, item.end);
    } else {
      ok = FillStitchedRows(columns, item.begin, item.end);
      for (int i : pooled_columns) {
        ok = ok && run(i, item.begin * places[i].per_row, item.end * places[i].per_row);
      }
    }
    if (!ok) bad_id.store(true);
  });
  if (bad_id.load()) return FirstBadId(op, layout, sites);
  return OkStatus();
}

template <typename T, typename Tid>
class PackedLookupOp : public OpKernel {
 public:
  explicit PackedLookupOp(OpKernelConstruction* c) : OpKernel(c) {
    OP_REQUIRES_OK(c, layout_.Init(c, /*with_combiners=*/true));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& table = ctx->input(0);
    OP_REQUIRES(ctx, TensorShapeUtils::IsMatrix(table.shape()),
                errors::InvalidArgument(kLookupOp, ": table must be a matrix [rows, dim]; ",
                                        "got ", table.shape().DebugString()));
    OP_REQUIRES_OK(ctx, layout_.CheckRows(kLookupOp, table.dim_size(0)));
    const int64_t d = table.dim_size(1);
    std::vector<Site<T, Tid>> sites;
    OP_REQUIRES_OK(ctx, ReadSites(ctx, kLookupOp, layout_, &sites));
    const int num_sites = layout_.size();

    OpOutputList outputs;
    OP_REQUIRES_OK(ctx, ctx->output_list("outputs", &outputs));
    OpInputList ids;
    OP_REQUIRES_OK(ctx, ctx->input_list("ids", &ids));
    std::vector<RowPlace<T>> places(num_sites);
    for (int i = 0; i < num_sites; ++i) {
      Tensor* t;
      OP_REQUIRES_OK(ctx, outputs.allocate(i, OutputShape(sites[i], ids[i], d), &t));
      places[i] = {t->flat<T>().data(), 1, d, d};
    }
    OP_REQUIRES_OK(ctx, RunLookup(ctx, kLookupOp, layout_, sites,
                                  std::vector<const T*>(num_sites, table.flat<T>().data()),
                                  std::vector<int64_t>(num_sites, d), places));
  }

 private:
  PackedLayout layout_;
};

// ---------------------------------------------------------------------------------
// PicassoStitchedLookup

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
// matrix holding the site's rows.
template <typename T, typename Tables>
Status SiteTables(const char* op, const PackedLayout& layout,
                  const std::vector<int64_t>& table_index, const Tables& tables,
                  std::vector<const T*>* values, std::vector<int64_t>* dims) {
  for (int i = 0; i < layout.size(); ++i) {
    const Tensor& table = tables[table_index[i]];
    if (!TensorShapeUtils::IsMatrix(table.shape())) {
      return errors::InvalidArgument(op, ": tables must be matrices; got ",
                                     table.shape().DebugString());
    }
    if (layout.end_row(i) > table.dim_size(0)) {
      return errors::InvalidArgument(op, ": ", layout.Feature(i), " occupies rows [",
                                     layout.offsets[i], ", ", layout.end_row(i),
                                     ") of packed table ", table_index[i], ", which has ",
                                     table.dim_size(0), " rows");
    }
    values->push_back(table.flat<T>().data());
    dims->push_back(table.dim_size(1));
  }
  return OkStatus();
}

// Looks up sites of several packed tables (site i reads tables[table_index[i]]) and
// writes them, together with dense inputs copied to their columns, into one [rows,
// width] output: a concatenation of the sites' outputs built without the copy.
template <typename T, typename Tid>
class StitchedLookupOp : public OpKernel {
 public:
  explicit StitchedLookupOp(OpKernelConstruction* c) : OpKernel(c) {
    OP_REQUIRES_OK(c, layout_.Init(c, /*with_combiners=*/true));
    OP_REQUIRES_OK(c, stitch_.Init(c, layout_.size()));
    OP_REQUIRES_OK(c, c->GetAttr("width", &width_));
    OP_REQUIRES_OK(c, c->GetAttr("table_index", &table_index_));
    OP_REQUIRES_OK(c, c->GetAttr("dense_columns", &dense_columns_));
    int num_tables, num_dense;
    OP_REQUIRES_OK(c, c->GetAttr("G", &num_tables));
    OP_REQUIRES_OK(c, c->GetAttr("M", &num_dense));
    OP_REQUIRES(c, table_index_.size() == layout_.size() && dense_columns_.size() == num_dense,
                errors::InvalidArgument(kStitchedOp, ": table_index needs one entry per site ",
                                        "and dense_columns one per dense input"));
    for (int64_t t : table_index_) {
      OP_REQUIRES(c, t >= 0 && t < num_tables,
                  errors::InvalidArgument(kStitchedOp, ": table_index ", t, " outside [0, ",
                                          num_tables, ")"));
    }
  }

  void Compute(OpKernelContext* ctx) override {
    OpInputList tables, dense;
    OP_REQUIRES_OK(ctx, ctx->input_list("tables", &tables));
    OP_REQUIRES_OK(ctx, ctx->input_list("dense", &dense));
    std::vector<Site<T, Tid>> sites;
    OP_REQUIRES_OK(ctx, ReadSites(ctx, kStitchedOp, layout_, &sites));
    const int num_sites = layout_.size();
    std::vector<const T*> site_tables;
    std::vector<int64_t> dims;
    OP_REQUIRES_OK(ctx, SiteTables(kStitchedOp, layout_, table_index_, tables, &site_tables,
                                   &dims));
    const int64_t rows = sites[0].out_rows() / stitch_.row_blocks[0];
    Tensor* output;
    OP_REQUIRES_OK(ctx, ctx->allocate_output("output", TensorShape({rows, width_}), &output));
    T* out = output->flat<T>().data();
    std::vector<RowPlace<T>> places(num_sites);
    for (int i = 0; i < num_sites; ++i) {
      OP_REQUIRES_OK(ctx, stitch_.Place(kStitchedOp, layout_, i, sites[i], rows, width_, dims[i],
                                        out, &places[i]));
    }
    // Every column is written exactly once (else the output would hold garbage).
    std::vector<std::pair<int64_t, int64_t>> spans;
    for (int i = 0; i < num_sites; ++i) {
      spans.push_back({stitch_.columns[i], stitch_.row_blocks[i] * dims[i]});
    }
    std::vector<int64_t> dense_width(dense.size());
    for (int m = 0; m < dense.size(); ++m) {
      OP_REQUIRES(ctx, rows > 0 ? dense[m].NumElements() % rows == 0 : dense[m].NumElements() == 0,
                  errors::InvalidArgument(kStitchedOp, ": dense input ", m, " has ",
                                          dense[m].NumElements(), " values, not a multiple of ",
                                          "the ", rows, " rows of the output"));
      dense_width[m] = rows > 0 ? dense[m].NumElements() / rows : 0;
      spans.push_back({dense_columns_[m], dense_width[m]});
    }
    std::sort(spans.begin(), spans.end());
    int64_t covered = 0;
    for (const auto& [column, span] : spans) {
      OP_REQUIRES(ctx, column == covered || rows == 0,
                  errors::InvalidArgument(kStitchedOp, ": the inputs must fill columns [0, ",
                                          width_, ") exactly once; column ", covered,
                                          " is followed by one at ", column));
      covered += span;
    }
    OP_REQUIRES(ctx, covered == width_ || rows == 0,
                errors::InvalidArgument(kStitchedOp, ": the inputs fill ", covered,
                                        " columns, not width ", width_));
    OP_REQUIRES_OK(ctx,
                   RunLookup(ctx, kStitchedOp, layout_, sites, site_tables, dims, places, rows));
    // Dense inputs: row r of input m to row r, columns from dense_columns[m].
    int64_t dense_bytes = 0;
    for (int64_t w : dense_width) dense_bytes += rows * w * sizeof(T);
    std::vector<WorkItem> items;
    for (int m = 0; m < dense.size(); ++m) {
      const int64_t row_bytes = std::max<int64_t>(1, dense_width[m] * sizeof(T));
      SplitWork(m, rows, std::max<int64_t>(1, TargetItemBytes(ctx, dense_bytes) / row_bytes),
                [](int64_t r) { return r; }, &items);
    }
    RunWorkItems(ctx, items.size(), dense_bytes >= kMinParallelBytes, [&](int64_t k) {
      const WorkItem& item = items[k];
      const int64_t w = dense_width[item.unit];
      const T* src = dense[item.unit].flat<T>().data();
      for (int64_t r = item.begin; r < item.end; ++r) {
        std::memcpy(out + r * width_ + dense_columns_[item.unit], src + r * w, w * sizeof(T));
      }
    });
  }

 private:
  PackedLayout layout_;
  StitchLayout stitch_;
  int64_t width_;
  std::vector<int64_t> table_index_;
  std::vector<int64_t> dense_columns_;
};

// ---------------------------------------------------------------------------------
// PicassoPackedLookupGrad

// Checks a pooled site's segment ids and, for mean and sqrtn, writes each segment's
// scale 1 / sum(w) or 1 / sqrt(sum(w^2)) (0 where the sum is 0, like div_no_nan),
// summing in the same order as the forward pass. False on a bad segment id.
template <typename T, typename Tid>
bool SegmentScales(const Site<T, Tid>& s, T* scale) {
  if (scale) std::fill(scale, scale + s.num_segments, T(0));
  for (int64_t j = 0; j < s.n; ++j) {
    const int64_t seg = s.segments[j];
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

// Writes the gradient rows of the unique rows [u0, u1) of a cluster: zeroes them, then
// adds every contribution of the cluster's entries in local entry order, so each row's
// sum has the same order whatever the item split or thread count.
template <int64_t kD, typename T, typename Tid>
void SumContributions(const std::vector<Site<T, Tid>>& sites,
                      const std::vector<RowPlace<const T>>& grads,
                      const std::vector<const T*>& scales,
                      const RowClusters::Cluster& c, int64_t u0, int64_t u1, int64_t d,
                      T* row_grads) {
  const int64_t width = kD ? kD : d;
  T* out = row_grads + c.unique_begin * width;
  std::fill(out + u0 * width, out + u1 * width, T(0));
  const bool all_rows = u0 == 0 && u1 == c.num_unique();
  const int64_t ahead = PrefetchDistance(width * sizeof(T));
  for (size_t k = 0; k < c.sites.size(); ++k) {
    const int i = c.sites[k];
    const Site<T, Tid> s = sites[i];  // a local copy: see GatherRows
    const uint32_t* inverse = c.inverse.get() + c.site_begin[k];
    const T* scale = scales[i];
    const RowPlace<const T> grad = grads[i];
    for (int64_t j = 0; j < s.n; ++j) {
      const int64_t u = inverse[j];
      if (!all_rows && (u < u0 || u >= u1)) continue;
      // Entry j reads gradient row j (combiner "none") or that of its segment.
      if (j + ahead < s.n) {
        PrefetchBytes(out + inverse[j + ahead] * width, width * sizeof(T));
        PrefetchBytes(grad(s.pooled ? s.segments[j + ahead] : j + ahead), width * sizeof(T));
      }
      const int64_t src = s.pooled ? s.segments[j] : j;
      T w = s.weights ? s.weights[j] : T(1);
      if (scale) w *= scale[src];
      AxpyRow<kD>(out + u * width, grad(src), w, d);
    }
  }
}

// The table gradient of PicassoPackedLookup (kStitched false: one gradient tensor per
// site) or of one table's sites of PicassoStitchedLookup (kStitched true: the sites'
// gradients are columns of the stitched output's gradient).
// A one-site, unpooled cluster of a stitched gradient, as SumBand reads it.
template <typename T>
struct GradColumn {
  const uint32_t* inverse;  // per entry, its row's index among the cluster's rows
  const T* weights;         // null: all 1
  RowPlace<const T> grad;
  T* out;                   // the cluster's first gradient row
  int64_t num_unique;       // its gradient rows
  int64_t d;
};

// Writes the gradient rows of a band of columns of a stitched gradient [rows, W],
// reading it row by row, left to right across the band (sequential loads, rather
// than one column, a load every W values, at a time). Prefetch streams as in
// FillStitchedRows: each column's inverse indexes a few rows down, and the gradient
// rows that the columns a few places to the right add to. Each row's sum keeps entry
// order, as in SumContributions.
template <typename T>
void SumBand(const std::vector<GradColumn<T>>& columns, int64_t rows) {
  constexpr int kRowsAhead = 8;
  const int n = static_cast<int>(columns.size());
  const int ahead = std::min(8, n - 1);
  for (const auto& col : columns) std::fill(col.out, col.out + col.num_unique * col.d, T(0));
  for (int64_t r = 0; r < rows; ++r) {
    int a = ahead;
    int64_t a_row = r;
    for (int c = 0; c < n; ++c) {
      const GradColumn<T>& col = columns[c];
      const int64_t k = col.grad.per_row;
      PrefetchBytes(col.inverse + (r + kRowsAhead) * k, k * sizeof(uint32_t));
      if (a_row < rows) {
        const GradColumn<T>& next = columns[a];
        PrefetchBytes(next.out + next.inverse[a_row * next.grad.per_row] * next.d,
                      next.d * sizeof(T));
      }
      if (++a == n) {
        a = 0;
        ++a_row;
      }
      DispatchDim(col.d, [&](auto dim) {
        constexpr int64_t kD = decltype(dim)::value;
        for (int64_t j = r * k; j < (r + 1) * k; ++j) {
          AxpyRow<kD>(col.out + col.inverse[j] * col.d, col.grad(j),
                      col.weights ? col.weights[j] : T(1), col.d);
        }
      });
    }
  }
}

// The table gradients of PicassoPackedLookup (kStitched false: one table, one
// gradient tensor per site) or of PicassoStitchedLookup (kStitched true: every table
// of the op; the sites' gradients are columns of the stitched output's gradient).
template <typename T, typename Tid, bool kStitched>
class PackedLookupGradOp : public OpKernel {
 public:
  explicit PackedLookupGradOp(OpKernelConstruction* c) : OpKernel(c) {
    OP_REQUIRES_OK(c, layout_.Init(c, /*with_combiners=*/true));
    const int n = layout_.size();
    if (kStitched) {
      OP_REQUIRES_OK(c, stitch_.Init(c, n));
      OP_REQUIRES_OK(c, c->GetAttr("table_index", &table_index_));
      OP_REQUIRES_OK(c, c->GetAttr("dims", &dims_));
      OP_REQUIRES_OK(c, c->GetAttr("num_rows", &num_rows_));
      OP_REQUIRES(c, table_index_.size() == n && dims_.size() == num_rows_.size(),
                  errors::InvalidArgument(kOpName, ": table_index needs one entry per site, ",
                                          "dims and num_rows one per table"));
    } else {
      int64_t num_rows;
      OP_REQUIRES_OK(c, c->GetAttr("num_rows", &num_rows));
      num_rows_ = {num_rows};
      table_index_.assign(n, 0);
    }
    OP_REQUIRES_OK(c, by_table_.Init(kOpName, layout_, table_index_, num_rows_.size()));
    for (size_t t = 0; t < num_rows_.size(); ++t) {
      OP_REQUIRES_OK(c, by_table_.layouts[t].CheckRows(kOpName, num_rows_[t]));
    }
  }

  void Compute(OpKernelContext* ctx) override {
    std::vector<Site<T, Tid>> sites;
    OP_REQUIRES_OK(ctx, ReadSites(ctx, kOpName, layout_, &sites));
    const int num_sites = layout_.size();
    const int num_tables = static_cast<int>(num_rows_.size());
    std::vector<RowPlace<const T>> grads(num_sites);
    std::vector<int64_t> dims = dims_;
    int64_t stitched_rows = 0;
    if (kStitched) {
      const Tensor& grad = ctx->input(0);
      OP_REQUIRES(ctx, TensorShapeUtils::IsMatrix(grad.shape()),
                  errors::InvalidArgument(kOpName, ": grad must be a matrix [rows, width]; got ",
                                          grad.shape().DebugString()));
      stitched_rows = grad.dim_size(0);
      for (int i = 0; i < num_sites; ++i) {
        OP_REQUIRES_OK(ctx, stitch_.Place(kOpName, layout_, i, sites[i], stitched_rows,
                                          grad.dim_size(1), dims[table_index_[i]],
                                          grad.flat<T>().data(), &grads[i]));
      }
    } else {
      OpInputList grad_list, ids;
      OP_REQUIRES_OK(ctx, ctx->input_list("grads", &grad_list));
      OP_REQUIRES_OK(ctx, ctx->input_list("ids", &ids));
      OP_REQUIRES(ctx, grad_list[0].dims() >= 2,
                  errors::InvalidArgument(kOpName, ": grads must have rank >= 2 [..., dim]; got ",
                                          grad_list[0].shape().DebugString()));
      const int64_t d = grad_list[0].dim_size(grad_list[0].dims() - 1);
      dims = {d};
      for (int i = 0; i < num_sites; ++i) {
        const TensorShape expected = OutputShape(sites[i], ids[i], d);
        OP_REQUIRES(ctx, grad_list[i].shape() == expected,
                    errors::InvalidArgument(kOpName, ": the gradient of ", layout_.Feature(i),
                                            " must have its lookup output's shape ",
                                            expected.DebugString(), "; got ",
                                            grad_list[i].shape().DebugString()));
        grads[i] = {grad_list[i].flat<T>().data(), 1, d, d};
      }
    }

    // Check the segment ids, and compute the per-segment scales of mean and sqrtn sites.
    std::vector<int> pooled_sites;
    int64_t scales_size = 0, pooled_ids = 0;
    for (int i = 0; i < num_sites; ++i) {
      if (!sites[i].pooled) continue;
      pooled_sites.push_back(i);
      pooled_ids += sites[i].n;
      if (sites[i].combiner != Combiner::kSum) scales_size += sites[i].num_segments;
    }
    std::unique_ptr<T[]> scale_buffer(new T[scales_size]);
    std::vector<const T*> scales(num_sites, nullptr);
    std::vector<T*> site_scale(num_sites, nullptr);
    T* next_scale = scale_buffer.get();
    for (int i : pooled_sites) {
      if (sites[i].combiner == Combiner::kSum) continue;
      scales[i] = site_scale[i] = next_scale;
      next_scale += sites[i].num_segments;
    }
    std::atomic<bool> bad_segment(false);
    RunWorkItems(ctx, pooled_sites.size(), pooled_ids >= kMinParallelEntries,
                 [&](int64_t k) {
                   const int i = pooled_sites[k];
                   if (!SegmentScales(sites[i], site_scale[i])) bad_segment.store(true);
                 });
    OP_REQUIRES(ctx, !bad_segment.load(), FirstBadSegment(kOpName, layout_, sites));

    // Each table's entries grouped by row; its sites numbered within the table.
    std::vector<TableGrad> tables(num_tables);
    OpOutputList unique_list, grads_list;
    OP_REQUIRES_OK(ctx, ctx->output_list("unique_rows", &unique_list));
    OP_REQUIRES_OK(ctx, ctx->output_list("row_grads", &grads_list));
    for (int t = 0; t < num_tables; ++t) {
      TableGrad& table = tables[t];
      for (int i : by_table_.sites[t]) {
        table.sites.push_back(sites[i]);
        table.grads.push_back(grads[i]);
        table.scales.push_back(scales[i]);
      }
      table.d = dims[t];
      OP_REQUIRES_OK(ctx, GroupByRow(ctx, kOpName, by_table_.layouts[t], table.sites, &table.groups));
      Tensor *unique_rows, *row_grads;
      OP_REQUIRES_OK(ctx, unique_list.allocate(t, TensorShape({table.groups.num_unique}),
                                               &unique_rows));
      OP_REQUIRES_OK(ctx, grads_list.allocate(t, TensorShape({table.groups.num_unique, table.d}),
                                              &row_grads));
      int64_t* rows = unique_rows->flat<int64_t>().data();
      for (const auto& c : table.groups.clusters) {
        std::copy(c.rows.begin(), c.rows.end(), rows + c.unique_begin);
      }
      table.out = row_grads->flat<T>().data();
    }

    // Items: whole clusters, except that a cluster costing more than an item's share
    // is split by ranges of its unique rows (each item then scans all its entries).
    // Stitched one-site unpooled clusters (the usual one-hot features) are grouped
    // instead into bands of neighbouring columns, one item each (SumBand).
    auto cluster_bytes = [&](int t, int k) {
      const RowClusters::Cluster& c = tables[t].groups.clusters[k];
      return (c.num_entries() + c.num_unique()) * std::max<int64_t>(1, tables[t].d * sizeof(T));
    };
    int64_t total_bytes = 0, band_bytes = 0;
    std::vector<std::pair<int, int>> band_clusters;  // (table, cluster)
    std::vector<std::vector<bool>> banded(num_tables);
    for (int t = 0; t < num_tables; ++t) {
      banded[t].resize(tables[t].groups.clusters.size());
      for (int k = 0; k < static_cast<int>(tables[t].groups.clusters.size()); ++k) {
        total_bytes += cluster_bytes(t, k);
        const RowClusters::Cluster& c = tables[t].groups.clusters[k];
        if (kStitched && c.sites.size() == 1 && !tables[t].sites[c.sites[0]].pooled &&
            c.num_entries() > 0) {
          band_clusters.push_back({t, k});
          band_bytes += cluster_bytes(t, k);
          banded[t][k] = true;
        }
      }
    }
    const int64_t target = TargetItemBytes(ctx, total_bytes);
    auto column_of = [&](const std::pair<int, int>& tk) {
      const TableGrad& table = tables[tk.first];
      const RowClusters::Cluster& c = table.groups.clusters[tk.second];
      const int i = c.sites[0];
      return GradColumn<T>{c.inverse.get(), table.sites[i].weights, table.grads[i],
                           table.out + c.unique_begin * table.d, c.num_unique(), table.d};
    };
    std::sort(band_clusters.begin(), band_clusters.end(), [&](const auto& a, const auto& b) {
      return column_of(a).grad.base < column_of(b).grad.base;
    });
    std::vector<std::vector<GradColumn<T>>> bands;
    const int64_t num_bands = std::clamp<int64_t>(band_bytes / target, 1, 2 * NumThreads(ctx));
    int64_t done = 0;
    for (const auto& tk : band_clusters) {
      if (bands.empty() || done >= band_bytes * static_cast<int64_t>(bands.size()) / num_bands) {
        bands.emplace_back();
      }
      bands.back().push_back(column_of(tk));
      done += cluster_bytes(tk.first, tk.second);
    }
    struct ClusterItem {
      int table, cluster;
      int64_t begin, end, bytes;
    };
    std::vector<ClusterItem> items;
    for (int t = 0; t < num_tables; ++t) {
      for (int k = 0; k < static_cast<int>(tables[t].groups.clusters.size()); ++k) {
        const RowClusters::Cluster& c = tables[t].groups.clusters[k];
        if (banded[t][k]) continue;
        const int64_t u = c.num_unique();
        const int64_t pieces = std::clamp<int64_t>(cluster_bytes(t, k) / target, 1, NumThreads(ctx));
        for (int64_t p = 0; p < pieces && u > 0; ++p) {
          items.push_back({t, k, u * p / pieces, u * (p + 1) / pieces, cluster_bytes(t, k) / pieces});
        }
      }
    }
    // Costliest first, so that the last items to be claimed are small ones.
    std::stable_sort(items.begin(), items.end(),
                     [](const ClusterItem& a, const ClusterItem& b) { return a.bytes > b.bytes; });
    const int64_t num_band_items = bands.size();
    RunWorkItems(ctx, num_band_items + items.size(), total_bytes >= kMinParallelBytes,
                 [&](int64_t k) {
                   if (k < num_band_items) {
                     SumBand(bands[k], stitched_rows);
                     return;
                   }
                   const ClusterItem& item = items[k - num_band_items];
                   const TableGrad& table = tables[item.table];
                   DispatchDim(table.d, [&](auto dim) {
                     SumContributions<decltype(dim)::value>(
                         table.sites, table.grads, table.scales,
                         table.groups.clusters[item.cluster], item.begin, item.end, table.d,
                         table.out);
                   });
                 });
  }

 private:
  // One table's share of the gradient: its sites (numbered within the table).
  struct TableGrad {
    std::vector<Site<T, Tid>> sites;
    std::vector<RowPlace<const T>> grads;
    std::vector<const T*> scales;
    RowClusters groups;
    T* out = nullptr;
    int64_t d = 0;
  };

  static constexpr const char* kOpName = kStitched ? kStitchedGradOp : kGradOp;
  PackedLayout layout_;
  StitchLayout stitch_;
  std::vector<int64_t> table_index_, dims_, num_rows_;
  TableSites by_table_;
};

// ---------------------------------------------------------------------------------
// PicassoStitchedProjection

// A stitched lookup that feeds only a narrow MatMul (a logistic regression, the wide
// part of a model) is folded into it: each output row is the sum over the sites of
// their rows' dot products with the kernel rows of their columns, so the stitched
// [rows, width] tensor is never written, nor its gradient read back.

// Outputs of a projection: at most this many (a wider MatMul is better left to BLAS).
constexpr int64_t kMaxProjectionUnits = 8;
// The projection's sites are split into at most this many bands (a fixed number, so
// that its sums do not depend on the number of threads).
constexpr int kProjectionBands = 8;

// A site's columns of the projection kernel, as the kernels below read them: kt holds
// the kernel transposed ([units, width]: output p's weights contiguous), and row j of
// the site's own output meets kernel rows column + (j % blocks) * d onwards.
template <typename T>
struct KernelSlice {
  const T* kt;
  int64_t width, units, column, blocks;

  // Where output p's weights for row j of the site start, in kt (or in a gradient of
  // the same layout).
  int64_t offset(int64_t p, int64_t j, int64_t d) const {
    return p * width + column + (j % blocks) * d;
  }
  const T* weights(int64_t p, int64_t j, int64_t d) const { return kt + offset(p, j, d); }
};

// The kernel [width, units] transposed to [units, width].
template <typename T>
std::vector<T> Transposed(const T* kernel, int64_t width, int64_t units) {
  std::vector<T> kt(width * units);
  for (int64_t c = 0; c < width; ++c) {
    for (int64_t p = 0; p < units; ++p) kt[p * width + c] = kernel[c * units + p];
  }
  return kt;
}

// The scale of a pooled segment of `count` ids (no weights): 1, 1 / count (mean) or
// 1 / sqrt(count) (sqrtn), 0 for an empty segment, as SegmentScales gives.
template <typename T>
T PoolScale(Combiner combiner, int64_t count) {
  if (combiner == Combiner::kSum) return T(1);
  const T denominator = combiner == Combiner::kMean ? T(count) : std::sqrt(T(count));
  return denominator == 0 ? T(0) : T(1) / denominator;
}

// Adds site s's share of output rows [r0, r1) to y [rows, units]: for each of its
// rows (pooled: segments) landing there, the row's dot products with the kernel.
// False on a bad id.
template <int64_t kD, typename T, typename Tid>
bool ProjectSite(const Site<T, Tid> s, const SegmentIndex index, const T* table, int64_t d,
                 const KernelSlice<T> k, int64_t r0, int64_t r1, T* y) {
  const T* base = table + s.offset * d;
  const int64_t row_bytes = d * sizeof(T);
  const int64_t ahead = PrefetchDistance(row_bytes);
  const int64_t begin = r0 * k.blocks, end = r1 * k.blocks;
  T sums[kMaxProjectionUnits];
  if (!s.pooled) {
    for (int64_t j = begin; j < end; ++j) {
      if (j + ahead < end) PrefetchBytes(RowAddress(base, s.ids[j + ahead], d), row_bytes);
      const Tid id = s.ids[j];
      if (!s.Valid(id)) return false;
      const T* row = base + static_cast<int64_t>(id) * d;
      T* out = y + (j / k.blocks) * k.units;
      for (int64_t p = 0; p < k.units; ++p) out[p] += DotRow<kD>(row, k.weights(p, j, d), d);
    }
    return true;
  }
  auto entry = [&index](int64_t q) -> int64_t { return index.perm ? index.perm[q] : q; };
  const int64_t q_end = index.start[end];
  for (int64_t seg = begin; seg < end; ++seg) {
    std::fill(sums, sums + k.units, T(0));
    const int64_t first = index.start[seg], last = index.start[seg + 1];
    for (int64_t q = first; q < last; ++q) {
      if (q + ahead < q_end) PrefetchBytes(RowAddress(base, s.ids[entry(q + ahead)], d), row_bytes);
      const Tid id = s.ids[entry(q)];
      if (!s.Valid(id)) return false;
      const T* row = base + static_cast<int64_t>(id) * d;
      for (int64_t p = 0; p < k.units; ++p) sums[p] += DotRow<kD>(row, k.weights(p, seg, d), d);
    }
    const T scale = PoolScale<T>(s.combiner, last - first);
    T* out = y + (seg / k.blocks) * k.units;
    for (int64_t p = 0; p < k.units; ++p) out[p] += sums[p] * scale;
  }
  return true;
}

// Checks what both projection ops take: no per-id weights, a [width, units] kernel
// with units <= kMaxProjectionUnits, and sites that fit the stitched columns without
// overlapping. Returns the rows through *rows (from the sites, or from the gradient).
template <typename T, typename Tid>
Status CheckProjection(const char* op, const PackedLayout& layout, const StitchLayout& stitch,
                       const std::vector<Site<T, Tid>>& sites, const std::vector<int64_t>& dims,
                       const Tensor& kernel, int64_t width, int64_t rows) {
  if (!TensorShapeUtils::IsMatrix(kernel.shape()) || kernel.dim_size(0) != width ||
      kernel.dim_size(1) < 1 || kernel.dim_size(1) > kMaxProjectionUnits) {
    return errors::InvalidArgument(op, ": kernel must be [width ", width, ", units] with 1 to ",
                                   kMaxProjectionUnits, " units; got ",
                                   kernel.shape().DebugString());
  }
  std::vector<std::pair<int64_t, int64_t>> spans;
  for (int i = 0; i < layout.size(); ++i) {
    if (sites[i].weights) {
      return errors::InvalidArgument(op, ": ", layout.Feature(i), " has per-id weights, "
                                     "which a projection does not take (stitch it without)");
    }
    TF_RETURN_IF_ERROR(stitch.Check(op, layout, i, sites[i], rows, width, dims[i]));
    spans.push_back({stitch.columns[i], stitch.columns[i] + stitch.row_blocks[i] * dims[i]});
  }
  std::sort(spans.begin(), spans.end());
  for (size_t k = 1; k < spans.size(); ++k) {
    if (spans[k].first < spans[k - 1].second) {
      return errors::InvalidArgument(op, ": two sites share column ", spans[k].first);
    }
  }
  return OkStatus();
}

// Reads the attributes both projection ops share.
struct ProjectionAttrs {
  PackedLayout layout;
  StitchLayout stitch;
  int64_t width = 0;
  std::vector<int64_t> table_index;
  TableSites by_table;

  Status Init(OpKernelConstruction* c, const char* op) {
    TF_RETURN_IF_ERROR(layout.Init(c, /*with_combiners=*/true));
    TF_RETURN_IF_ERROR(stitch.Init(c, layout.size()));
    TF_RETURN_IF_ERROR(c->GetAttr("width", &width));
    TF_RETURN_IF_ERROR(c->GetAttr("table_index", &table_index));
    int num_tables;
    TF_RETURN_IF_ERROR(c->GetAttr("G", &num_tables));
    if (table_index.size() != layout.size()) {
      return errors::InvalidArgument(op, ": table_index needs one entry per site");
    }
    return by_table.Init(op, layout, table_index, num_tables);
  }
};

// y [rows, units] = the stitched lookup of the sites (never built) times kernel
// [width, units]; columns no site covers are left to the caller.
template <typename T, typename Tid>
class StitchedProjectionOp : public OpKernel {
 public:
  explicit StitchedProjectionOp(OpKernelConstruction* c) : OpKernel(c) {
    OP_REQUIRES_OK(c, attrs_.Init(c, kProjectionOp));
  }

  void Compute(OpKernelContext* ctx) override {
    const PackedLayout& layout = attrs_.layout;
    OpInputList tables;
    OP_REQUIRES_OK(ctx, ctx->input_list("tables", &tables));
    std::vector<Site<T, Tid>> sites;
    OP_REQUIRES_OK(ctx, ReadSites(ctx, kProjectionOp, layout, &sites));
    std::vector<const T*> site_tables;
    std::vector<int64_t> dims;
    OP_REQUIRES_OK(ctx, SiteTables(kProjectionOp, layout, attrs_.table_index, tables,
                                   &site_tables, &dims));
    const Tensor& kernel = ctx->input(ctx->num_inputs() - 1);
    const int64_t rows = sites[0].out_rows() / attrs_.stitch.row_blocks[0];
    OP_REQUIRES_OK(ctx, CheckProjection(kProjectionOp, layout, attrs_.stitch, sites, dims,
                                        kernel, attrs_.width, rows));
    const int64_t units = kernel.dim_size(1);
    Tensor* output;
    OP_REQUIRES_OK(ctx, ctx->allocate_output("output", TensorShape({rows, units}), &output));
    T* y = output->flat<T>().data();
    std::fill(y, y + rows * units, T(0));
    PooledIndexes pooled;
    OP_REQUIRES_OK(ctx, pooled.Build(ctx, kProjectionOp, layout, sites));
    const std::vector<T> kt = Transposed(kernel.flat<T>().data(), attrs_.width, units);

    // Sites are walked one at a time (its ids in order, its table's hot rows in cache),
    // in a fixed number of consecutive bands, each summing into its own partial output;
    // items are (band, block of rows). The partials are added in band order, so every
    // sum has one order whatever the threads.
    const int num_sites = layout.size();
    const int num_bands = std::min(num_sites, kProjectionBands);
    int64_t total_bytes = 0;
    for (int i = 0; i < num_sites; ++i) total_bytes += sites[i].n * dims[i] * sizeof(T);
    const int64_t blocks_per_band = std::clamp<int64_t>(
        NumThreads(ctx) * kItemsPerThread / num_bands, 1, std::max<int64_t>(1, rows / 64));
    const int64_t block = std::max<int64_t>(1, (rows + blocks_per_band - 1) / blocks_per_band);
    std::vector<T> partials((num_bands - 1) * rows * units, T(0));
    auto band_output = [&](int b) { return b == 0 ? y : partials.data() + (b - 1) * rows * units; };
    std::atomic<bool> bad_id(false);
    RunWorkItems(ctx, num_bands * blocks_per_band, total_bytes >= kMinParallelBytes,
                 [&](int64_t item) {
      const int band = static_cast<int>(item / blocks_per_band);
      const int64_t r0 = (item % blocks_per_band) * block, r1 = std::min(rows, r0 + block);
      for (int i = band * num_sites / num_bands;
           i < (band + 1) * num_sites / num_bands && r0 < r1 && !bad_id.load(); ++i) {
        const KernelSlice<T> k{kt.data(), attrs_.width, units, attrs_.stitch.columns[i],
                               attrs_.stitch.row_blocks[i]};
        const bool ok = DispatchDim(dims[i], [&](auto dim) {
          return ProjectSite<decltype(dim)::value>(sites[i], pooled.index[i], site_tables[i],
                                                    dims[i], k, r0, r1, band_output(band));
        });
        if (!ok) bad_id.store(true);
      }
    });
    OP_REQUIRES(ctx, !bad_id.load(), FirstBadId(kProjectionOp, layout, sites));
    for (int b = 1; b < num_bands; ++b) {
      const T* partial = band_output(b);
      for (int64_t k = 0; k < rows * units; ++k) y[k] += partial[k];
    }
  }

 private:
  ProjectionAttrs attrs_;
};

// The gradients of a projection from dy [rows, units]: each table's row-sparse
// gradient and the kernel's. For a site and each unique row u of its cluster, the
// entries' upstream rows are first summed, s_u = sum of scale * dy[row] (units
// values), then row u's gradient gains kernel slice * s_u and the kernel slice gains
// table[u] * s_u: one pass over the ids, then work per unique row only. A cluster is
// one work item; its sites' kernel columns are its own, so every sum has one order.
// `out` receives the cluster's [unique rows, d] gradient.
template <int64_t kD, typename T, typename Tid>
void ProjectClusterGrad(const std::vector<Site<T, Tid>>& sites,
                        const std::vector<KernelSlice<T>>& slices,
                        const std::vector<const T*>& scales, const RowClusters::Cluster& c,
                        const T* table, int64_t d, const T* dy, T* out, T* dkt) {
  const int64_t num_unique = c.num_unique();
  const int64_t units = slices.empty() ? 0 : slices[0].units;
  std::fill(out, out + num_unique * d, T(0));
  thread_local std::vector<T> sums;
  for (size_t k = 0; k < c.sites.size(); ++k) {
    const int i = c.sites[k];
    const Site<T, Tid> s = sites[i];
    const KernelSlice<T> slice = slices[i];
    const uint32_t* inverse = c.inverse.get() + c.site_begin[k];
    for (int64_t slot = 0; slot < slice.blocks; ++slot) {
      sums.assign(num_unique * units, T(0));
      if (s.pooled) {
        for (int64_t j = 0; j < s.n; ++j) {
          const int64_t seg = s.segments[j];
          if (seg % slice.blocks != slot) continue;
          const T scale = scales[i] ? scales[i][seg] : T(1);
          const T* g = dy + (seg / slice.blocks) * units;
          T* sum = sums.data() + inverse[j] * units;
          for (int64_t p = 0; p < units; ++p) sum[p] += scale * g[p];
        }
      } else {
        for (int64_t j = slot; j < s.n; j += slice.blocks) {
          const T* g = dy + (j / slice.blocks) * units;
          T* sum = sums.data() + inverse[j] * units;
          for (int64_t p = 0; p < units; ++p) sum[p] += g[p];
        }
      }
      const int64_t ahead = PrefetchDistance(d * sizeof(T));
      for (int64_t u = 0; u < num_unique; ++u) {
        if (u + ahead < num_unique) {
          PrefetchBytes(table + c.rows[u + ahead] * d, d * sizeof(T));
          PrefetchBytes(out + (u + ahead) * d, d * sizeof(T));
        }
        const T* sum = sums.data() + u * units;
        const T* row = table + c.rows[u] * d;
        for (int64_t p = 0; p < units; ++p) {
          if (sum[p] == T(0)) continue;
          AxpyRow<kD>(out + u * d, slice.weights(p, slot, d), sum[p], d);
          AxpyRow<kD>(dkt + slice.offset(p, slot, d), row, sum[p], d);
        }
      }
    }
  }
}

// What both projection gradient ops compute from dy [rows, units], the kernel and the
// tables' values: the inputs checked, each table's entries grouped by row, then each
// cluster's row gradients, and the kernel's gradient.
template <typename T, typename Tid>
class ProjectionGradient {
 public:
  struct Table {
    std::vector<Site<T, Tid>> sites;
    std::vector<KernelSlice<T>> slices;
    std::vector<const T*> scales;
    RowClusters groups;
    const T* values = nullptr;
    int64_t d = 0;
  };

  // `tables` holds the tables' values (anything indexable by table giving a Tensor).
  template <typename Tables>
  Status Prepare(OpKernelContext* ctx, const char* op, const ProjectionAttrs& attrs,
                 const Tables& tables) {
    attrs_ = &attrs;
    const PackedLayout& layout = attrs.layout;
    dy_ = &ctx->input(0);
    const Tensor& kernel = ctx->input(1);
    std::vector<Site<T, Tid>> sites;
    TF_RETURN_IF_ERROR(ReadSites(ctx, op, layout, &sites));
    std::vector<const T*> site_tables;
    std::vector<int64_t> dims;
    TF_RETURN_IF_ERROR(SiteTables(op, layout, attrs.table_index, tables, &site_tables, &dims));
    if (!TensorShapeUtils::IsMatrix(dy_->shape()) || dy_->dim_size(1) != kernel.dim_size(1)) {
      return errors::InvalidArgument(op, ": grad must be [rows, units] with the kernel's ",
                                     "units; got ", dy_->shape().DebugString(), " and kernel ",
                                     kernel.shape().DebugString());
    }
    TF_RETURN_IF_ERROR(CheckProjection(op, layout, attrs.stitch, sites, dims, kernel,
                                       attrs.width, dy_->dim_size(0)));
    units_ = kernel.dim_size(1);
    const int num_sites = layout.size();

    // Per-segment scales of mean and sqrtn sites (checking the segment ids).
    scale_buffers_.assign(num_sites, {});
    std::vector<const T*> scales(num_sites, nullptr);
    for (int i = 0; i < num_sites; ++i) {
      if (!sites[i].pooled) continue;
      const bool scaled = sites[i].combiner != Combiner::kSum;
      if (scaled) scale_buffers_[i].resize(sites[i].num_segments);
      if (!SegmentScales(sites[i], scaled ? scale_buffers_[i].data() : nullptr)) {
        return FirstBadSegment(op, layout, sites);
      }
      if (scaled) scales[i] = scale_buffers_[i].data();
    }
    kt_ = Transposed(kernel.flat<T>().data(), attrs.width, units_);
    dkt_.assign(units_ * attrs.width, T(0));

    // Each table's entries grouped by row.
    tables_ = std::vector<Table>(attrs.by_table.sites.size());
    for (size_t t = 0; t < tables_.size(); ++t) {
      Table& g = tables_[t];
      g.values = tables[t].template flat<T>().data();
      g.d = tables[t].dim_size(1);
      for (int i : attrs.by_table.sites[t]) {
        g.sites.push_back(sites[i]);
        g.slices.push_back({kt_.data(), attrs.width, units_, attrs.stitch.columns[i],
                            attrs.stitch.row_blocks[i]});
        g.scales.push_back(scales[i]);
      }
      TF_RETURN_IF_ERROR(GroupByRow(ctx, op, attrs.by_table.layouts[t], g.sites, &g.groups));
    }
    return OkStatus();
  }

  const std::vector<Table>& tables() const { return tables_; }

  // Computes each cluster's row gradients into out(t, cluster), a [unique rows, d] buffer,
  // then calls done(t, cluster, that buffer), on one thread per cluster: clusters of
  // one table cover disjoint rows.
  template <typename OutFn, typename DoneFn>
  void Run(OpKernelContext* ctx, const OutFn& out, const DoneFn& done) {
    std::vector<std::pair<int, int>> items;  // (table, cluster)
    for (size_t t = 0; t < tables_.size(); ++t) {
      for (size_t k = 0; k < tables_[t].groups.clusters.size(); ++k) items.push_back({t, k});
    }
    auto cost = [&](const std::pair<int, int>& item) {
      const auto& c = tables_[item.first].groups.clusters[item.second];
      return c.num_entries() + c.num_unique() * tables_[item.first].d;
    };
    std::stable_sort(items.begin(), items.end(),
                     [&](const auto& a, const auto& b) { return cost(a) > cost(b); });
    int64_t total = 0;
    for (const auto& item : items) total += cost(item);
    RunWorkItems(ctx, items.size(), total * sizeof(T) >= kMinParallelBytes, [&](int64_t k) {
      const int t = items[k].first;
      const Table& g = tables_[t];
      const RowClusters::Cluster& c = g.groups.clusters[items[k].second];
      T* grads = out(t, c);
      DispatchDim(g.d, [&](auto dim) {
        ProjectClusterGrad<decltype(dim)::value>(g.sites, g.slices, g.scales, c, g.values, g.d,
                                                 dy_->flat<T>().data(), grads, dkt_.data());
      });
      done(t, c, grads);
    });
  }

  // The kernel's gradient, once Run is done.
  Status KernelGrad(OpKernelContext* ctx) const {
    Tensor* kernel_grad;
    TF_RETURN_IF_ERROR(ctx->allocate_output("kernel_grad", ctx->input(1).shape(), &kernel_grad));
    T* dk = kernel_grad->flat<T>().data();
    const int64_t width = attrs_->width;
    for (int64_t c = 0; c < width; ++c) {
      for (int64_t p = 0; p < units_; ++p) dk[c * units_ + p] = dkt_[p * width + c];
    }
    return OkStatus();
  }

 private:
  const ProjectionAttrs* attrs_ = nullptr;
  const Tensor* dy_ = nullptr;
  int64_t units_ = 0;
  std::vector<std::vector<T>> scale_buffers_;
  std::vector<T> kt_, dkt_;
  std::vector<Table> tables_;
};

template <typename T, typename Tid>
class StitchedProjectionGradOp : public OpKernel {
 public:
  explicit StitchedProjectionGradOp(OpKernelConstruction* c) : OpKernel(c) {
    OP_REQUIRES_OK(c, attrs_.Init(c, kProjectionGradOp));
  }

  void Compute(OpKernelContext* ctx) override {
    OpInputList tables;
    OP_REQUIRES_OK(ctx, ctx->input_list("tables", &tables));
    ProjectionGradient<T, Tid> gradient;
    OP_REQUIRES_OK(ctx, gradient.Prepare(ctx, kProjectionGradOp, attrs_, tables));
    OpOutputList unique_list, grads_list;
    OP_REQUIRES_OK(ctx, ctx->output_list("unique_rows", &unique_list));
    OP_REQUIRES_OK(ctx, ctx->output_list("row_grads", &grads_list));
    std::vector<T*> row_grads;
    for (size_t t = 0; t < gradient.tables().size(); ++t) {
      const auto& g = gradient.tables()[t];
      Tensor *unique, *grads;
      OP_REQUIRES_OK(ctx, unique_list.allocate(t, TensorShape({g.groups.num_unique}), &unique));
      OP_REQUIRES_OK(ctx, grads_list.allocate(t, TensorShape({g.groups.num_unique, g.d}), &grads));
      int64_t* rows = unique->flat<int64_t>().data();
      for (const auto& c : g.groups.clusters) {
        std::copy(c.rows.begin(), c.rows.end(), rows + c.unique_begin);
      }
      row_grads.push_back(grads->flat<T>().data());
    }
    gradient.Run(
        ctx,
        [&](int t, const RowClusters::Cluster& c) {
          return row_grads[t] + c.unique_begin * gradient.tables()[t].d;
        },
        [](int, const RowClusters::Cluster&, const T*) {});
    OP_REQUIRES_OK(ctx, gradient.KernelGrad(ctx));
  }

 private:
  ProjectionAttrs attrs_;
};

// The projection's gradient applied by an optimizer to the tables in place: each
// cluster's row gradients go to the optimizer's update of those rows (their table
// rows still in cache from the kernel gradient) instead of to an output, and only
// the kernel's gradient is returned. Rows without a gradient are left alone (the
// lazy form, which is Keras' own for Adagrad and momentum-free SGD). Each table row's
// value is read for the kernel gradient before its own cluster updates it.
template <typename T, typename Tid>
class StitchedProjectionGradApplyOp : public OpKernel {
 public:
  explicit StitchedProjectionGradApplyOp(OpKernelConstruction* c) : OpKernel(c), update_(c) {
    OP_REQUIRES_OK(c, attrs_.Init(c, kProjectionGradApplyOp));
    OP_REQUIRES_OK(c, c->GetAttr("num_slots", &num_slots_));
    OP_REQUIRES_OK(c, c->GetAttr("hyper_names", &hyper_names_));
    int num_tables, num_table_slots;
    OP_REQUIRES_OK(c, c->GetAttr("G", &num_tables));
    OP_REQUIRES_OK(c, c->GetAttr("num_table_slots", &num_table_slots));
    OP_REQUIRES(c, num_table_slots == num_tables * num_slots_,
                errors::InvalidArgument(kProjectionGradApplyOp, ": ", num_tables, " tables with ",
                                        num_slots_, " slots each need ", num_tables * num_slots_,
                                        " slot variables; got ", num_table_slots));
  }

  void Compute(OpKernelContext* ctx) override {
    int vars_begin, vars_end, slots_begin, slots_end;
    OP_REQUIRES_OK(ctx, InputRange("vars", &vars_begin, &vars_end));
    OP_REQUIRES_OK(ctx, InputRange("slots", &slots_begin, &slots_end));
    std::vector<int> inputs;
    for (int i = vars_begin; i < vars_end; ++i) inputs.push_back(i);
    for (int i = slots_begin; i < slots_end; ++i) inputs.push_back(i);
    picasso::LockedVariables locked;
    OP_REQUIRES_OK(ctx, locked.Lock(ctx, inputs, DataTypeToEnum<T>::v()));
    std::vector<Tensor> vars;  // the tables, then table-major slots
    OP_REQUIRES_OK(ctx, locked.Tensors<T>(ctx, &vars));
    const int num_tables = vars_end - vars_begin;
    for (int t = 0; t < num_tables; ++t) {
      for (int k = 0; k < num_slots_; ++k) {
        const Tensor& slot = vars[num_tables + t * num_slots_ + k];
        OP_REQUIRES(ctx, slot.shape() == vars[t].shape(),
                    errors::InvalidArgument(kProjectionGradApplyOp, ": slot ", k, " of table ",
                                            t, " has shape ", slot.shape().DebugString(),
                                            ", the table ", vars[t].shape().DebugString()));
      }
    }
    ProjectionGradient<T, Tid> gradient;
    OP_REQUIRES_OK(ctx, gradient.Prepare(ctx, kProjectionGradApplyOp, attrs_, vars));

    picasso::ScalarInputs<T> scalars(ctx, hyper_names_, "hyper");
    const T lr = scalars("lr"), weight_decay = scalars("weight_decay");
    OP_REQUIRES_OK(ctx, update_.With(scalars, [&](const auto& update) {
      gradient.Run(
          ctx,
          [&](int t, const RowClusters::Cluster& c) {
            thread_local std::vector<T> buffer;
            buffer.resize(c.num_unique() * vars[t].dim_size(1));
            return buffer.data();
          },
          [&](int t, const RowClusters::Cluster& c, const T* grads) {
            const int64_t d = vars[t].dim_size(1);
            T* table = vars[t].flat<T>().data();
            T* slot_tables[picasso::kMaxSlots] = {};
            for (int k = 0; k < num_slots_; ++k) {
              slot_tables[k] = vars[num_tables + t * num_slots_ + k].flat<T>().data();
            }
            const int64_t ahead = PrefetchDistance(d * sizeof(T));
            T* slots[picasso::kMaxSlots] = {};
            for (int64_t u = 0; u < c.num_unique(); ++u) {
              if (u + ahead < c.num_unique()) {
                for (int k = 0; k < num_slots_; ++k) {
                  PrefetchBytes(slot_tables[k] + c.rows[u + ahead] * d, d * sizeof(T));
                }
              }
              const int64_t row = c.rows[u];
              for (int k = 0; k < num_slots_; ++k) slots[k] = slot_tables[k] + row * d;
              picasso::UpdateRow<true>(update, table + row * d, slots, grads + u * d, d,
                                       weight_decay, lr);
            }
          });
    }));
    OP_REQUIRES_OK(ctx, gradient.KernelGrad(ctx));
  }

 private:
  ProjectionAttrs attrs_;
  picasso::AnyUpdate<T> update_;
  int num_slots_ = 0;
  std::vector<std::string> hyper_names_;
};

// ---------------------------------------------------------------------------------
// Registration

Status PackedUniqueShape(InferenceContext* c) {
  int n;
  TF_RETURN_IF_ERROR(c->GetAttr("N", &n));
  c->set_output(0, c->Vector(InferenceContext::kUnknownDim));
  for (int i = 0; i < n; ++i) c->set_output(1 + i, c->input(i));
  c->set_output(1 + n, c->Vector(InferenceContext::kUnknownDim));
  return OkStatus();
}

Status PackedLookupShape(InferenceContext* c) {
  int n;
  std::vector<std::string> combiners;
  TF_RETURN_IF_ERROR(c->GetAttr("N", &n));
  TF_RETURN_IF_ERROR(c->GetAttr("combiners", &combiners));
  if (combiners.size() != n) {
    return errors::InvalidArgument(kLookupOp, ": combiners needs one entry per site (", n,
                                   "); got ", combiners.size());
  }
  ShapeHandle table;
  TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 2, &table));
  for (int i = 0; i < n; ++i) {
    if (combiners[i] == "none") {  // ids.shape + [D]
      ShapeHandle out;
      TF_RETURN_IF_ERROR(c->Concatenate(c->input(1 + i), c->Vector(c->Dim(table, 1)), &out));
      c->set_output(i, out);
      continue;
    }
    ShapeHandle ids;
    TF_RETURN_IF_ERROR(c->WithRank(c->input(1 + i), 1, &ids));
    DimensionHandle rows;
    TF_RETURN_IF_ERROR(c->MakeDimForScalarInput(1 + 3 * n + i, &rows));
    c->set_output(i, c->Matrix(rows, c->Dim(table, 1)));
  }
  return OkStatus();
}

Status StitchedLookupShape(InferenceContext* c) {
  int64_t width;
  TF_RETURN_IF_ERROR(c->GetAttr("width", &width));
  c->set_output(0, c->Matrix(InferenceContext::kUnknownDim, width));
  return OkStatus();
}

Status StitchedLookupGradShape(InferenceContext* c) {
  std::vector<int64_t> dims;
  TF_RETURN_IF_ERROR(c->GetAttr("dims", &dims));
  ShapeHandle grad;
  TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 2, &grad));
  for (size_t t = 0; t < dims.size(); ++t) {
    c->set_output(t, c->Vector(InferenceContext::kUnknownDim));
    c->set_output(dims.size() + t, c->Matrix(InferenceContext::kUnknownDim, dims[t]));
  }
  return OkStatus();
}

Status ProjectionShape(InferenceContext* c) {
  ShapeHandle kernel;
  TF_RETURN_IF_ERROR(c->WithRank(c->input(c->num_inputs() - 1), 2, &kernel));
  c->set_output(0, c->Matrix(InferenceContext::kUnknownDim, c->Dim(kernel, 1)));
  return OkStatus();
}

Status ProjectionGradShape(InferenceContext* c) {
  int num_tables;
  TF_RETURN_IF_ERROR(c->GetAttr("G", &num_tables));
  for (int t = 0; t < num_tables; ++t) {
    ShapeHandle table;
    TF_RETURN_IF_ERROR(c->WithRank(c->input(2 + t), 2, &table));
    c->set_output(t, c->Vector(InferenceContext::kUnknownDim));
    c->set_output(num_tables + t, c->Matrix(InferenceContext::kUnknownDim, c->Dim(table, 1)));
  }
  c->set_output(2 * num_tables, c->input(1));
  return OkStatus();
}

Status PackedLookupGradShape(InferenceContext* c) {
  ShapeHandle grad;
  TF_RETURN_IF_ERROR(c->WithRankAtLeast(c->input(0), 2, &grad));
  c->set_output(0, c->Vector(InferenceContext::kUnknownDim));
  c->set_output(1, c->Matrix(InferenceContext::kUnknownDim, c->Dim(grad, -1)));
  return OkStatus();
}

}  // namespace

REGISTER_OP("PicassoPackedUnique")
    .Input("ids: N * Tid")
    .Output("unique_rows: int64")
    .Output("inverse: N * int32")
    .Output("counts: int32")
    .Attr("N: int >= 1")
    .Attr("Tid: {int32, int64}")
    .Attr("offsets: list(int)")
    .Attr("vocab_sizes: list(int)")
    .Attr("feature_names: list(string)")
    .SetShapeFn(PackedUniqueShape)
    .Doc(R"doc(
Deduplicates the packed rows (id + offsets[i]) of all sites' ids, in ascending order.

unique_rows: the distinct packed rows, ascending.
inverse: for each id (same shape as its ids input), its index into unique_rows.
counts: how many ids map to each unique row.
)doc");

REGISTER_OP("PicassoPackedLookup")
    .Input("table: T")
    .Input("ids: N * Tid")
    .Input("segment_ids: N * int64")
    .Input("weights: N * T")
    .Input("num_segments: N * int64")
    .Output("outputs: N * T")
    .Attr("N: int >= 1")
    .Attr("T: {float, double}")
    .Attr("Tid: {int32, int64}")
    .Attr("offsets: list(int)")
    .Attr("vocab_sizes: list(int)")
    .Attr("combiners: list(string)")
    .Attr("feature_names: list(string)")
    .SetShapeFn(PackedLookupShape)
    .Doc(R"doc(
Looks up every site's ids in a packed table [R, D] and pools them per segment.

Site i reads rows offsets[i] + ids[i]. combiners[i] "none": outputs[i] is [n_i, D],
row j = weights[j] * table[offset + ids[j]] (segment_ids[i] empty). "sum", "mean",
"sqrtn": outputs[i] is [num_segments[i], D], the weighted sum of the rows whose
segment id is s, divided by sum(w) (mean) or sqrt(sum(w^2)) (sqrtn), zero rows for
empty segments, as tf.nn.embedding_lookup_sparse. Empty weights mean all ones.
)doc");

REGISTER_OP("PicassoPackedLookupGrad")
    .Input("grads: N * T")
    .Input("ids: N * Tid")
    .Input("segment_ids: N * int64")
    .Input("weights: N * T")
    .Input("num_segments: N * int64")
    .Output("unique_rows: int64")
    .Output("row_grads: T")
    .Attr("N: int >= 1")
    .Attr("T: {float, double}")
    .Attr("Tid: {int32, int64}")
    .Attr("num_rows: int >= 0")
    .Attr("offsets: list(int)")
    .Attr("vocab_sizes: list(int)")
    .Attr("combiners: list(string)")
    .Attr("feature_names: list(string)")
    .SetShapeFn(PackedLookupGradShape)
    .Doc(R"doc(
The table gradient of PicassoPackedLookup, row-sparse and deterministic.

unique_rows: the packed rows that received a gradient, ascending.
row_grads: [U, D], the summed gradient of each of those rows.
)doc");

REGISTER_OP("PicassoStitchedLookup")
    .Input("tables: G * T")
    .Input("ids: N * Tid")
    .Input("segment_ids: N * int64")
    .Input("weights: N * T")
    .Input("num_segments: N * int64")
    .Input("dense: M * T")
    .Output("output: T")
    .Attr("G: int >= 1")
    .Attr("N: int >= 1")
    .Attr("M: int >= 0")
    .Attr("T: {float, double}")
    .Attr("Tid: {int32, int64}")
    .Attr("width: int >= 1")
    .Attr("table_index: list(int)")
    .Attr("columns: list(int)")
    .Attr("row_blocks: list(int)")
    .Attr("dense_columns: list(int)")
    .Attr("offsets: list(int)")
    .Attr("vocab_sizes: list(int)")
    .Attr("combiners: list(string)")
    .Attr("feature_names: list(string)")
    .SetShapeFn(StitchedLookupShape)
    .Doc(R"doc(
Looks up sites of several packed tables straight into one [rows, width] output.

Site i reads tables[table_index[i]] like PicassoPackedLookup and writes its output
rows into columns [columns[i], columns[i] + row_blocks[i] * D), row_blocks[i] of its
rows side by side per output row; dense input m (rows * w_m values) fills columns
[dense_columns[m], dense_columns[m] + w_m). Together they fill every column once.
)doc");

REGISTER_OP("PicassoStitchedLookupGrad")
    .Input("grad: T")
    .Input("ids: N * Tid")
    .Input("segment_ids: N * int64")
    .Input("weights: N * T")
    .Input("num_segments: N * int64")
    .Output("unique_rows: G * int64")
    .Output("row_grads: G * T")
    .Attr("G: int >= 1")
    .Attr("N: int >= 1")
    .Attr("T: {float, double}")
    .Attr("Tid: {int32, int64}")
    .Attr("table_index: list(int)")
    .Attr("num_rows: list(int)")
    .Attr("dims: list(int)")
    .Attr("columns: list(int)")
    .Attr("row_blocks: list(int)")
    .Attr("offsets: list(int)")
    .Attr("vocab_sizes: list(int)")
    .Attr("combiners: list(string)")
    .Attr("feature_names: list(string)")
    .SetShapeFn(StitchedLookupGradShape)
    .Doc(R"doc(
The gradients of the packed tables [num_rows[t], dims[t]] of a PicassoStitchedLookup
from the gradient of its output, whose columns hold the sites' gradients, read in
place. Per table, like PicassoPackedLookupGrad: ascending unique rows, summed rows.
)doc");

REGISTER_OP("PicassoStitchedProjection")
    .Input("tables: G * T")
    .Input("ids: N * Tid")
    .Input("segment_ids: N * int64")
    .Input("weights: N * T")
    .Input("num_segments: N * int64")
    .Input("kernel: T")
    .Output("output: T")
    .Attr("G: int >= 1")
    .Attr("N: int >= 1")
    .Attr("T: {float, double}")
    .Attr("Tid: {int32, int64}")
    .Attr("width: int >= 1")
    .Attr("table_index: list(int)")
    .Attr("columns: list(int)")
    .Attr("row_blocks: list(int)")
    .Attr("offsets: list(int)")
    .Attr("vocab_sizes: list(int)")
    .Attr("combiners: list(string)")
    .Attr("feature_names: list(string)")
    .SetShapeFn(ProjectionShape)
    .Doc(R"doc(
The product of a stitched lookup (as PicassoStitchedLookup lays out its sites, in
columns of a [rows, width] tensor) with kernel [width, units], units <= 8, without
building the lookup: output [rows, units]. Columns no site covers contribute
nothing. Sites take no per-id weights.
)doc");

REGISTER_OP("PicassoStitchedProjectionGrad")
    .Input("grad: T")
    .Input("kernel: T")
    .Input("tables: G * T")
    .Input("ids: N * Tid")
    .Input("segment_ids: N * int64")
    .Input("weights: N * T")
    .Input("num_segments: N * int64")
    .Output("unique_rows: G * int64")
    .Output("row_grads: G * T")
    .Output("kernel_grad: T")
    .Attr("G: int >= 1")
    .Attr("N: int >= 1")
    .Attr("T: {float, double}")
    .Attr("Tid: {int32, int64}")
    .Attr("width: int >= 1")
    .Attr("table_index: list(int)")
    .Attr("columns: list(int)")
    .Attr("row_blocks: list(int)")
    .Attr("offsets: list(int)")
    .Attr("vocab_sizes: list(int)")
    .Attr("combiners: list(string)")
    .Attr("feature_names: list(string)")
    .SetShapeFn(ProjectionGradShape)
    .Doc(R"doc(
The gradients of PicassoStitchedProjection from that of its output: per table,
ascending unique rows and their summed gradient rows; and the kernel's gradient
(zero in the columns no site covers).
)doc");

REGISTER_OP("PicassoStitchedProjectionGradApply")
    .Input("grad: T")
    .Input("kernel: T")
    .Input("vars: G * resource")
    .Input("slots: num_table_slots * resource")
    .Input("ids: N * Tid")
    .Input("segment_ids: N * int64")
    .Input("weights: N * T")
    .Input("num_segments: N * int64")
    .Input("hyper: num_hyper * T")
    .Output("kernel_grad: T")
    .Attr("G: int >= 1")
    .Attr("N: int >= 1")
    .Attr("T: {float, double}")
    .Attr("Tid: {int32, int64}")
    .Attr("width: int >= 1")
    .Attr("table_index: list(int)")
    .Attr("columns: list(int)")
    .Attr("row_blocks: list(int)")
    .Attr("offsets: list(int)")
    .Attr("vocab_sizes: list(int)")
    .Attr("combiners: list(string)")
    .Attr("feature_names: list(string)")
    .Attr("optimizer: {'sgd', 'adagrad', 'ftrl', 'adam', 'rmsprop'}")
    .Attr("num_slots: int >= 0")
    .Attr("num_table_slots: int >= 0")
    .Attr("num_hyper: int >= 0")
    .Attr("hyper_names: list(string)")
    .Attr("nesterov: bool = false")
    .Attr("amsgrad: bool = false")
    .Attr("centered: bool = false")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->input(1));
      return OkStatus();
    })
    .Doc(R"doc(
PicassoStitchedProjectionGrad with the tables' gradients applied in place by an
optimizer (sparse_updates.h) instead of returned: vars are the G tables' variables,
slots their optimizer slots table by table (num_slots each, in the order the
PicassoSparseApply op of `optimizer` takes them), hyper that op's scalar inputs in
the order of hyper_names. Only the rows with a gradient are updated. Returns the
kernel's gradient.
)doc");

#define REGISTER_PACKED_LOOKUP(T, Tid)                                                   \
  REGISTER_KERNEL_BUILDER(Name("PicassoPackedLookup")                                    \
                              .Device(DEVICE_CPU)                                        \
                              .TypeConstraint<T>("T")                                    \
                              .TypeConstraint<Tid>("Tid"),                               \
                          PackedLookupOp<T, Tid>);                                       \
  REGISTER_KERNEL_BUILDER(Name("PicassoPackedLookupGrad")                                \
                              .Device(DEVICE_CPU)                                        \
                              .TypeConstraint<T>("T")                                    \
                              .TypeConstraint<Tid>("Tid"),                               \
                          PackedLookupGradOp<T, Tid, false>);                            \
  REGISTER_KERNEL_BUILDER(Name("PicassoStitchedLookup")                                  \
                              .Device(DEVICE_CPU)                                        \
                              .TypeConstraint<T>("T")                                    \
                              .TypeConstraint<Tid>("Tid"),                               \
                          StitchedLookupOp<T, Tid>);                                     \
  REGISTER_KERNEL_BUILDER(Name("PicassoStitchedLookupGrad")                              \
                              .Device(DEVICE_CPU)                                        \
                              .TypeConstraint<T>("T")                                    \
                              .TypeConstraint<Tid>("Tid"),                               \
                          PackedLookupGradOp<T, Tid, true>);                             \
  REGISTER_KERNEL_BUILDER(Name("PicassoStitchedProjection")                              \
                              .Device(DEVICE_CPU)                                        \
                              .TypeConstraint<T>("T")                                    \
                              .TypeConstraint<Tid>("Tid"),                               \
                          StitchedProjectionOp<T, Tid>);                                 \
  REGISTER_KERNEL_BUILDER(Name("PicassoStitchedProjectionGrad")                          \
                              .Device(DEVICE_CPU)                                        \
                              .TypeConstraint<T>("T")                                    \
                              .TypeConstraint<Tid>("Tid"),                               \
                          StitchedProjectionGradOp<T, Tid>);                             \
  REGISTER_KERNEL_BUILDER(Name("PicassoStitchedProjectionGradApply")                     \
                              .Device(DEVICE_CPU)                                        \
                              .TypeConstraint<T>("T")                                    \
                              .TypeConstraint<Tid>("Tid"),                               \
                          StitchedProjectionGradApplyOp<T, Tid>);
REGISTER_PACKED_LOOKUP(float, int32_t)
REGISTER_PACKED_LOOKUP(float, int64_t)
REGISTER_PACKED_LOOKUP(double, int32_t)
REGISTER_PACKED_LOOKUP(double, int64_t)
#undef REGISTER_PACKED_LOOKUP

REGISTER_KERNEL_BUILDER(
    Name("PicassoPackedUnique").Device(DEVICE_CPU).TypeConstraint<int32_t>("Tid"),
    PackedUniqueOp<int32_t>);
REGISTER_KERNEL_BUILDER(
    Name("PicassoPackedUnique").Device(DEVICE_CPU).TypeConstraint<int64_t>("Tid"),
    PackedUniqueOp<int64_t>);

}  // namespace tensorflow
