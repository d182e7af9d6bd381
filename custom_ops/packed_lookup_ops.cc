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
//   PicassoPackedLookupGradApply, PicassoStitchedLookupGradApply  the same gradients,
//                            each table's rows handed to an optimizer's update as
//                            soon as they are summed.
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

#include "packed_sites.h"
#include "sparse_updates.h"
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/framework/tensor_shape.h"

namespace tensorflow {
namespace {

constexpr char kUniqueOp[] = "PicassoPackedUnique";
constexpr char kLookupOp[] = "PicassoPackedLookup";
constexpr char kStitchedOp[] = "PicassoStitchedLookup";

// Item size in bytes for `total_bytes` bytes of rows spread over the threads.
int64_t TargetItemBytes(OpKernelContext* ctx, int64_t total_bytes) {
  return std::max<int64_t>(kMinItemBytes, total_bytes / (NumThreads(ctx) * kItemsPerThread));
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
// An id weighted exactly 0 (a masked sequence's padding) adds 0 x its row, which is 0
// for a finite row: it is checked and counts in the weight sum, but its row is not
// read. Its gradient, 0 x its segment's, is skipped alike (SumContributions), while
// its row still counts among the rows read: the update touches the rows it did.
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
    bool written = false;
    for (int64_t p = first; p < last; ++p) {
      if (p + ahead < p_end) {
        PrefetchBytes(RowAddress(base, s.ids[entry(p + ahead)], width), row_bytes);
      }
      const int64_t j = entry(p);
      const Tid id = s.ids[j];
      if (!s.Valid(id)) return false;
      const T w = s.weights ? s.weights[j] : T(1);
      weight_sum += s.combiner == Combiner::kSqrtN ? w * w : w;
      if (w == T(0)) continue;
      const T* src = base + static_cast<int64_t>(id) * width;
      if (!written) {
        ScaleRow<kD>(dst, src, w, d);
        written = true;
      } else {
        AxpyRow<kD>(dst, src, w, d);
      }
    }
    if (!written) std::fill(dst, dst + width, T(0));
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
    OP_REQUIRES_OK(c, c->GetAttr("table_index", &table_index_));
    int num_tables;
    OP_REQUIRES_OK(c, c->GetAttr("G", &num_tables));
    TableSites by_table;  // checks table_index
    OP_REQUIRES_OK(c, by_table.Init(kLookupOp, layout_, table_index_, num_tables));
  }

  void Compute(OpKernelContext* ctx) override {
    OpInputList tables;
    OP_REQUIRES_OK(ctx, ctx->input_list("tables", &tables));
    std::vector<const T*> values;
    std::vector<int64_t> dims;
    std::vector<Site<T, Tid>> sites;
    OP_REQUIRES_OK(ctx, ReadSites(ctx, kLookupOp, layout_, &sites));
    OP_REQUIRES_OK(ctx, SiteTables(kLookupOp, layout_, table_index_, tables, &sites, &values,
                                   &dims));
    const int num_sites = layout_.size();

    OpOutputList outputs;
    OP_REQUIRES_OK(ctx, ctx->output_list("outputs", &outputs));
    OpInputList ids;
    OP_REQUIRES_OK(ctx, ctx->input_list("ids", &ids));
    std::vector<RowPlace<T>> places(num_sites);
    for (int i = 0; i < num_sites; ++i) {
      Tensor* t;
      const int64_t d = dims[i];
      OP_REQUIRES_OK(ctx, outputs.allocate(i, OutputShape(sites[i], ids[i], d), &t));
      places[i] = {t->flat<T>().data(), 1, d, d};
    }
    OP_REQUIRES_OK(ctx, RunLookup(ctx, kLookupOp, layout_, sites, values, dims, places));
  }

 private:
  PackedLayout layout_;
  std::vector<int64_t> table_index_;
};

// ---------------------------------------------------------------------------------
// PicassoStitchedLookup

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
    OP_REQUIRES_OK(ctx, SiteTables(kStitchedOp, layout_, table_index_, tables, &sites, &site_tables,
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
    OP_REQUIRES_OK(ctx, ::picasso::CheckColumnsFilled(kStitchedOp, spans, width_, rows));
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
    // A site pooled by row reads its segments' gradient rows in ascending order, one
    // row per L entries: its segment is counted along (no divide) and not prefetched.
    const bool by_row = s.pooled && !s.segments;
    int64_t row = 0, row_end = s.row_length;
    for (int64_t j = 0; j < s.n; ++j) {
      if (by_row && j == row_end) {
        ++row;
        row_end += s.row_length;
      }
      const int64_t u = inverse[j];
      if (!all_rows && (u < u0 || u >= u1)) continue;
      T w = s.weights ? s.weights[j] : T(1);
      if (w == T(0)) continue;  // adds 0: see PoolSegments
      // Entry j reads gradient row j (combiner "none") or that of its segment.
      if (j + ahead < s.n) {
        PrefetchBytes(out + inverse[j + ahead] * width, width * sizeof(T));
        if (!by_row) {
          PrefetchBytes(grad(s.pooled ? s.segments[j + ahead] : j + ahead), width * sizeof(T));
        }
      }
      const int64_t src = by_row ? row : s.pooled ? s.segments[j] : j;
      if (scale) w *= scale[src];
      AxpyRow<kD>(out + u * width, grad(src), w, d);
    }
  }
}

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

// SumBand's loop over the rows, for columns all of width kD (0: any widths, each
// column's row loop picked per row).
template <int64_t kD, typename T>
void SumBandRows(const std::vector<GradColumn<T>>& columns, int64_t rows) {
  constexpr int kRowsAhead = 8;
  const int n = static_cast<int>(columns.size());
  const int ahead = std::min(8, n - 1);
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
      if constexpr (kD == 0) {
        DispatchDim(col.d, [&](auto dim) {
          constexpr int64_t kW = decltype(dim)::value;
          for (int64_t j = r * k; j < (r + 1) * k; ++j) {
            AxpyRow<kW>(col.out + col.inverse[j] * col.d, col.grad(j),
                        col.weights ? col.weights[j] : T(1), col.d);
          }
        });
      } else {
        for (int64_t j = r * k; j < (r + 1) * k; ++j) {
          AxpyRow<kD>(col.out + col.inverse[j] * kD, col.grad(j),
                      col.weights ? col.weights[j] : T(1), kD);
        }
      }
    }
  }
}

// Writes the gradient rows of a band of columns of a stitched gradient [rows, W],
// reading it row by row, left to right across the band (sequential loads, rather
// than one column, a load every W values, at a time). Prefetch streams as in
// FillStitchedRows: each column's inverse indexes a few rows down, and the gradient
// rows that the columns a few places to the right add to. Each row's sum keeps entry
// order, as in SumContributions. A band of one width picks its row loop once.
template <typename T>
void SumBand(const std::vector<GradColumn<T>>& columns, int64_t rows) {
  for (const auto& col : columns) std::fill(col.out, col.out + col.num_unique * col.d, T(0));
  const int64_t d = columns.front().d;
  const bool one_width = std::all_of(columns.begin(), columns.end(),
                                     [d](const GradColumn<T>& col) { return col.d == d; });
  if (!one_width) {
    SumBandRows<0>(columns, rows);
    return;
  }
  DispatchDim(d, [&](auto dim) { SumBandRows<decltype(dim)::value>(columns, rows); });
}

// The attributes of a lookup gradient: kStitched false, PicassoPackedLookupGrad (one
// table, one gradient tensor per site); true, PicassoStitchedLookupGrad(Apply) (every
// table of a PicassoStitchedLookup, the sites' gradients columns of its output's).
template <bool kStitched>
struct LookupGradAttrs {
  Status Init(OpKernelConstruction* c) {
    op = c->def().op();
    TF_RETURN_IF_ERROR(layout.Init(c, /*with_combiners=*/true));
    const int n = layout.size();
    if (kStitched) TF_RETURN_IF_ERROR(stitch.Init(c, n));
    TF_RETURN_IF_ERROR(c->GetAttr("table_index", &table_index));
    TF_RETURN_IF_ERROR(c->GetAttr("dims", &dims));
    TF_RETURN_IF_ERROR(c->GetAttr("num_rows", &num_rows));
    int num_tables;
    TF_RETURN_IF_ERROR(c->GetAttr("G", &num_tables));
    if (table_index.size() != n || dims.size() != num_tables || num_rows.size() != num_tables) {
      return errors::InvalidArgument(op, ": table_index needs one entry per site (", n,
                                     "), dims and num_rows one per table (", num_tables, ")");
    }
    for (int t = 0; t < num_tables; ++t) {
      if (num_rows[t] < 0 || dims[t] < 0) {
        return errors::InvalidArgument(op, ": table ", t, " has num_rows ", num_rows[t],
                                       " and dims ", dims[t], "; both must be >= 0");
      }
    }
    TF_RETURN_IF_ERROR(by_table.Init(op.c_str(), layout, table_index, num_rows.size()));
    for (size_t t = 0; t < num_rows.size(); ++t) {
      TF_RETURN_IF_ERROR(by_table.layouts[t].CheckRows(op.c_str(), num_rows[t]));
    }
    return OkStatus();
  }

  std::string op;
  PackedLayout layout;
  StitchLayout stitch;
  std::vector<int64_t> table_index, dims, num_rows;
  TableSites by_table;
};

// One call's table gradients (see LookupGradAttrs): Prepare reads the inputs and
// groups each table's entries by row; Run sums every unique row's gradient.
template <typename T, typename Tid, bool kStitched>
class LookupGradients {
 public:
  Status Prepare(OpKernelContext* ctx, const LookupGradAttrs<kStitched>& attrs) {
    const char* op = attrs.op.c_str();
    const PackedLayout& layout = attrs.layout;
    std::vector<Site<T, Tid>> sites;
    TF_RETURN_IF_ERROR(ReadSites(ctx, op, layout, &sites));
    const int num_sites = layout.size();
    std::vector<RowPlace<const T>> grads(num_sites);
    std::vector<int64_t> dims = attrs.dims;
    if (kStitched) {
      const Tensor& grad = ctx->input(0);
      if (!TensorShapeUtils::IsMatrix(grad.shape())) {
        return errors::InvalidArgument(op, ": grad must be a matrix [rows, width]; got ",
                                       grad.shape().DebugString());
      }
      stitched_rows_ = grad.dim_size(0);
      for (int i = 0; i < num_sites; ++i) {
        TF_RETURN_IF_ERROR(attrs.stitch.Place(op, layout, i, sites[i], stitched_rows_,
                                              grad.dim_size(1), dims[attrs.table_index[i]],
                                              grad.flat<T>().data(), &grads[i]));
      }
    } else {
      OpInputList grad_list, ids;
      TF_RETURN_IF_ERROR(ctx->input_list("grads", &grad_list));
      TF_RETURN_IF_ERROR(ctx->input_list("ids", &ids));
      for (int i = 0; i < num_sites; ++i) {
        const int64_t d = dims[attrs.table_index[i]];
        const TensorShape expected = OutputShape(sites[i], ids[i], d);
        if (grad_list[i].shape() != expected) {
          return errors::InvalidArgument(op, ": the gradient of ", layout.Feature(i),
                                         " must have its lookup output's shape ",
                                         expected.DebugString(), "; got ",
                                         grad_list[i].shape().DebugString());
        }
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
    scale_buffer_.reset(new T[scales_size]);
    std::vector<T*> scales(num_sites, nullptr);
    T* next_scale = scale_buffer_.get();
    for (int i : pooled_sites) {
      if (sites[i].combiner == Combiner::kSum) continue;
      scales[i] = next_scale;
      next_scale += sites[i].num_segments;
    }
    std::atomic<bool> bad_segment(false);
    RunWorkItems(ctx, pooled_sites.size(), pooled_ids >= kMinParallelEntries,
                 [&](int64_t k) {
                   const int i = pooled_sites[k];
                   if (!SegmentScales(sites[i], scales[i])) bad_segment.store(true);
                 });
    if (bad_segment.load()) return FirstBadSegment(op, layout, sites);

    // Each table's entries grouped by row; its sites numbered within the table.
    tables_ = std::vector<TableGrad>(attrs.num_rows.size());
    std::vector<SitesOfTable<Site<T, Tid>>> grouped;
    for (size_t t = 0; t < tables_.size(); ++t) {
      TableGrad& table = tables_[t];
      for (int i : attrs.by_table.sites[t]) {
        table.sites.push_back(sites[i]);
        table.grads.push_back(grads[i]);
        table.scales.push_back(scales[i]);
      }
      table.d = dims[t];
      grouped.push_back({&attrs.by_table.layouts[t], &table.sites, &table.groups});
    }
    return GroupTablesByRow(ctx, op, grouped);
  }

  int num_tables() const { return static_cast<int>(tables_.size()); }
  const RowClusters& groups(int t) const { return tables_[t].groups; }
  int64_t dim(int t) const { return tables_[t].d; }

  // Writes table t's gradient rows to out[t] ([groups(t).num_unique, dim(t)], in the
  // order of its clusters' rows). done(t, rows, n, grads) receives each run of n
  // finished rows right after its work item has summed it, while it is likely still in
  // cache: from several threads at once, for disjoint rows.
  template <typename Done>
  void Run(OpKernelContext* ctx, const std::vector<T*>& out, const Done& done) {
    for (int t = 0; t < num_tables(); ++t) tables_[t].out = out[t];
    // Items: whole clusters, except that a cluster holding at least one and a half
    // threads' shares of the work is split by ranges of its unique rows, into as many
    // pieces as the shares it holds (rounded; each piece then scans all its entries).
    // Stitched one-site unpooled clusters (the usual one-hot features) are grouped
    // instead into bands of neighbouring columns, one item each (SumBand).
    auto cluster_bytes = [&](int t, int k) {
      const RowClusters::Cluster& c = tables_[t].groups.clusters[k];
      return (c.num_entries() + c.num_unique()) * std::max<int64_t>(1, tables_[t].d * sizeof(T));
    };
    int64_t total_bytes = 0, band_bytes = 0;
    std::vector<std::pair<int, int>> band_clusters;  // (table, cluster)
    std::vector<std::vector<bool>> banded(num_tables());
    for (int t = 0; t < num_tables(); ++t) {
      banded[t].resize(tables_[t].groups.clusters.size());
      for (int k = 0; k < static_cast<int>(tables_[t].groups.clusters.size()); ++k) {
        total_bytes += cluster_bytes(t, k);
        const RowClusters::Cluster& c = tables_[t].groups.clusters[k];
        if (kStitched && c.sites.size() == 1 && !tables_[t].sites[c.sites[0]].pooled &&
            c.num_entries() > 0) {
          band_clusters.push_back({t, k});
          band_bytes += cluster_bytes(t, k);
          banded[t][k] = true;
        }
      }
    }
    const int64_t target = TargetItemBytes(ctx, total_bytes);
    auto column_of = [&](const std::pair<int, int>& tk) {
      const TableGrad& table = tables_[tk.first];
      const RowClusters::Cluster& c = table.groups.clusters[tk.second];
      const int i = c.sites[0];
      return GradColumn<T>{c.inverse.get(), table.sites[i].weights, table.grads[i],
                           table.out + c.unique_begin * table.d, c.num_unique(), table.d};
    };
    std::sort(band_clusters.begin(), band_clusters.end(), [&](const auto& a, const auto& b) {
      return column_of(a).grad.base < column_of(b).grad.base;
    });
    std::vector<std::vector<GradColumn<T>>> bands;
    std::vector<std::vector<std::pair<int, int>>> band_members;
    const int64_t num_bands = std::clamp<int64_t>(band_bytes / target, 1, 2 * NumThreads(ctx));
    int64_t done_bytes = 0;
    for (const auto& tk : band_clusters) {
      if (bands.empty() ||
          done_bytes >= band_bytes * static_cast<int64_t>(bands.size()) / num_bands) {
        bands.emplace_back();
        band_members.emplace_back();
      }
      bands.back().push_back(column_of(tk));
      band_members.back().push_back(tk);
      done_bytes += cluster_bytes(tk.first, tk.second);
    }
    struct ClusterItem {
      int table, cluster;
      int64_t begin, end, bytes;
    };
    std::vector<ClusterItem> items;
    for (int t = 0; t < num_tables(); ++t) {
      for (int k = 0; k < static_cast<int>(tables_[t].groups.clusters.size()); ++k) {
        const RowClusters::Cluster& c = tables_[t].groups.clusters[k];
        if (banded[t][k]) continue;
        const int64_t u = c.num_unique();
        // Scanning all of a cluster's entries, testing each against its rows, costs each
        // piece about what the whole cluster costs: one of several similar clusters stays whole.
        const int64_t threads = NumThreads(ctx);
        const int64_t pieces = std::clamp<int64_t>(
            (2 * cluster_bytes(t, k) * threads + total_bytes) / std::max<int64_t>(1, 2 * total_bytes), 1,
            threads);
        for (int64_t p = 0; p < pieces && u > 0; ++p) {
          items.push_back({t, k, u * p / pieces, u * (p + 1) / pieces, cluster_bytes(t, k) / pieces});
        }
      }
    }
    // Costliest first, so that the last items to be claimed are small ones.
    std::stable_sort(items.begin(), items.end(),
                     [](const ClusterItem& a, const ClusterItem& b) { return a.bytes > b.bytes; });
    auto finished = [&](int t, int k, int64_t begin, int64_t end) {
      const TableGrad& table = tables_[t];
      const RowClusters::Cluster& c = table.groups.clusters[k];
      done(t, c.rows.data() + begin, end - begin, table.out + (c.unique_begin + begin) * table.d);
    };
    const int64_t num_band_items = bands.size();
    RunWorkItems(ctx, num_band_items + items.size(), total_bytes >= kMinParallelBytes,
                 [&](int64_t k) {
                   if (k < num_band_items) {
                     SumBand(bands[k], stitched_rows_);
                     for (const auto& [t, cluster] : band_members[k]) {
                       finished(t, cluster, 0, tables_[t].groups.clusters[cluster].num_unique());
                     }
                     return;
                   }
                   const ClusterItem& item = items[k - num_band_items];
                   const TableGrad& table = tables_[item.table];
                   DispatchDim(table.d, [&](auto dim) {
                     SumContributions<decltype(dim)::value>(
                         table.sites, table.grads, table.scales,
                         table.groups.clusters[item.cluster], item.begin, item.end, table.d,
                         table.out);
                   });
                   finished(item.table, item.cluster, item.begin, item.end);
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

  std::vector<TableGrad> tables_;
  std::unique_ptr<T[]> scale_buffer_;
  int64_t stitched_rows_ = 0;
};

// PicassoPackedLookupGrad (kStitched false) and PicassoStitchedLookupGrad (true): per
// table, its ascending unique rows and their gradient rows.
template <typename T, typename Tid, bool kStitched>
class PackedLookupGradOp : public OpKernel {
 public:
  explicit PackedLookupGradOp(OpKernelConstruction* c) : OpKernel(c) {
    OP_REQUIRES_OK(c, attrs_.Init(c));
  }

  void Compute(OpKernelContext* ctx) override {
    LookupGradients<T, Tid, kStitched> gradients;
    OP_REQUIRES_OK(ctx, gradients.Prepare(ctx, attrs_));
    OpOutputList unique_list, grads_list;
    OP_REQUIRES_OK(ctx, ctx->output_list("unique_rows", &unique_list));
    OP_REQUIRES_OK(ctx, ctx->output_list("row_grads", &grads_list));
    std::vector<T*> out(gradients.num_tables());
    for (int t = 0; t < gradients.num_tables(); ++t) {
      const RowClusters& groups = gradients.groups(t);
      Tensor *unique_rows, *row_grads;
      OP_REQUIRES_OK(ctx, unique_list.allocate(t, TensorShape({groups.num_unique}), &unique_rows));
      OP_REQUIRES_OK(ctx, grads_list.allocate(t, TensorShape({groups.num_unique, gradients.dim(t)}),
                                              &row_grads));
      int64_t* rows = unique_rows->flat<int64_t>().data();
      for (const auto& c : groups.clusters) {
        std::copy(c.rows.begin(), c.rows.end(), rows + c.unique_begin);
      }
      out[t] = row_grads->flat<T>().data();
    }
    gradients.Run(ctx, out, [](int, const int64_t*, int64_t, const T*) {});
  }

 private:
  LookupGradAttrs<kStitched> attrs_;
};

// PicassoPackedLookupGrad (kStitched false) and PicassoStitchedLookupGrad (true) with
// each table's gradient rows handed to an optimizer's in-place update
// (picasso::InPlaceUpdates) as soon as they are summed, while they are in cache,
// instead of being returned.
template <typename T, typename Tid, bool kStitched>
class LookupGradApplyOp : public OpKernel {
 public:
  explicit LookupGradApplyOp(OpKernelConstruction* c) : OpKernel(c), updates_(c) {
    OP_REQUIRES_OK(c, attrs_.Init(c));
  }

  void Compute(OpKernelContext* ctx) override {
    // The ids are grouped and checked before the tables are locked: that reads no table.
    LookupGradients<T, Tid, kStitched> gradients;
    OP_REQUIRES_OK(ctx, gradients.Prepare(ctx, attrs_));
    typename picasso::InPlaceUpdates<T>::Locked vars;
    OP_REQUIRES_OK(ctx, vars.Lock(ctx, updates_));
    for (size_t t = 0; t < attrs_.num_rows.size(); ++t) {
      const TensorShape expected({attrs_.num_rows[t], attrs_.dims[t]});
      OP_REQUIRES(ctx, vars.tensors()[t].shape() == expected,
                  errors::InvalidArgument(attrs_.op, ": table ", t, " has shape ",
                                          vars.tensors()[t].shape().DebugString(), "; expected ",
                                          expected.DebugString()));
    }
    std::vector<Tensor> buffers(gradients.num_tables());
    std::vector<T*> out(gradients.num_tables());
    for (int t = 0; t < gradients.num_tables(); ++t) {
      OP_REQUIRES_OK(ctx, ctx->allocate_temp(DataTypeToEnum<T>::v(),
                                             TensorShape({gradients.groups(t).num_unique,
                                                          gradients.dim(t)}),
                                             &buffers[t]));
      out[t] = buffers[t].flat<T>().data();
    }
    OP_REQUIRES_OK(ctx, vars.Run(ctx, [&](const auto& apply) { gradients.Run(ctx, out, apply); }));
  }

 private:
  LookupGradAttrs<kStitched> attrs_;
  picasso::InPlaceUpdates<T> updates_;
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
  int num_tables;
  std::vector<int64_t> table_index;
  TF_RETURN_IF_ERROR(c->GetAttr("G", &num_tables));
  TF_RETURN_IF_ERROR(c->GetAttr("table_index", &table_index));
  if (table_index.size() != n) {
    return errors::InvalidArgument(kLookupOp, ": table_index needs one entry per site (", n,
                                   "); got ", table_index.size());
  }
  for (int i = 0; i < n; ++i) {
    if (table_index[i] < 0 || table_index[i] >= num_tables) {
      return errors::InvalidArgument(kLookupOp, ": table_index ", table_index[i], " outside [0, ",
                                     num_tables, ")");
    }
    ShapeHandle table;
    TF_RETURN_IF_ERROR(c->WithRank(c->input(table_index[i]), 2, &table));
    const int ids_input = num_tables + i;
    if (combiners[i] == "none") {  // ids.shape + [D]
      ShapeHandle out;
      TF_RETURN_IF_ERROR(c->Concatenate(c->input(ids_input), c->Vector(c->Dim(table, 1)), &out));
      c->set_output(i, out);
      continue;
    }
    const ShapeHandle given = c->input(ids_input);
    if (c->RankKnown(given) && c->Rank(given) >= 2) {  // pooled by row: ids.shape[:-1] + [D]
      ShapeHandle rows_shape, out;
      TF_RETURN_IF_ERROR(c->Subshape(given, 0, -1, &rows_shape));
      TF_RETURN_IF_ERROR(c->Concatenate(rows_shape, c->Vector(c->Dim(table, 1)), &out));
      c->set_output(i, out);
      continue;
    }
    ShapeHandle ids;
    TF_RETURN_IF_ERROR(c->WithRank(given, 1, &ids));
    DimensionHandle rows;
    TF_RETURN_IF_ERROR(c->MakeDimForScalarInput(num_tables + 3 * n + i, &rows));
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

// Per table t of a lookup gradient: unique rows [U_t] and their gradients [U_t, dims[t]].
Status TableGradsShape(InferenceContext* c) {
  std::vector<int64_t> dims;
  TF_RETURN_IF_ERROR(c->GetAttr("dims", &dims));
  for (size_t t = 0; t < dims.size(); ++t) {
    c->set_output(t, c->Vector(InferenceContext::kUnknownDim));
    c->set_output(dims.size() + t, c->Matrix(InferenceContext::kUnknownDim, dims[t]));
  }
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
    .Input("tables: G * T")
    .Input("ids: N * Tid")
    .Input("segment_ids: N * int64")
    .Input("weights: N * T")
    .Input("num_segments: N * int64")
    .Output("outputs: N * T")
    .Attr("G: int >= 1")
    .Attr("N: int >= 1")
    .Attr("T: {float, double}")
    .Attr("Tid: {int32, int64}")
    .Attr("table_index: list(int)")
    PICASSO_SITE_ATTRS
    .SetShapeFn(PackedLookupShape)
    .Doc(R"doc(
Looks up every site's ids in its table [R, D] and pools them per segment.

Site i reads rows offsets[i] + ids[i] of tables[table_index[i]]. combiners[i] "none":
outputs[i] is [n_i, D], row j = weights[j] * table[offset + ids[j]] (segment_ids[i]
empty). "sum", "mean", "sqrtn": outputs[i] is [num_segments[i], D], the weighted sum
of the rows whose segment id is s, divided by sum(w) (mean) or sqrt(sum(w^2)) (sqrtn),
zero rows for empty segments, as tf.nn.embedding_lookup_sparse. Empty weights mean
all ones.
)doc");

REGISTER_OP("PicassoPackedLookupGrad")
    .Input("grads: N * T")
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
    PICASSO_SITE_ATTRS
    .SetShapeFn(TableGradsShape)
    .Doc(R"doc(
The tables' gradients of PicassoPackedLookup, row-sparse and deterministic.

unique_rows[t]: the rows of table t that received a gradient, ascending.
row_grads[t]: [U_t, dims[t]], the summed gradient of each of those rows.
)doc");

// What a lookup gradient that applies its tables' rows in place takes after its
// upstream gradient: the tables' variables, their slots, the sites and the optimizer's
// scalars (as sparse_updates.h's InPlaceUpdates reads them).
#define PICASSO_GRAD_APPLY_SIGNATURE                 \
  .Input("vars: G * resource")                       \
      .Input("slots: num_table_slots * resource")    \
      .Input("ids: N * Tid")                         \
      .Input("segment_ids: N * int64")               \
      .Input("weights: N * T")                       \
      .Input("num_segments: N * int64")              \
      .Input("hyper: num_hyper * T")                 \
      .Attr("G: int >= 1")                           \
      .Attr("N: int >= 1")                           \
      .Attr("T: {float, double}")                    \
      .Attr("Tid: {int32, int64}")                   \
      .Attr("table_index: list(int)")                \
      .Attr("num_rows: list(int)")                   \
      .Attr("dims: list(int)")

REGISTER_OP("PicassoPackedLookupGradApply")
    .Input("grads: N * T")
    PICASSO_GRAD_APPLY_SIGNATURE
    PICASSO_SITE_ATTRS
    PICASSO_IN_PLACE_UPDATE_ATTRS
    .SetIsStateful()
    .SetShapeFn(shape_inference::NoOutputs)
    .Doc(R"doc(
PicassoPackedLookupGrad with the tables' gradients applied in place by an optimizer,
as PicassoStitchedLookupGradApply does for a stitched lookup.
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
    PICASSO_STITCH_ATTRS
    .Attr("dense_columns: list(int)")
    PICASSO_SITE_ATTRS
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
    PICASSO_STITCH_ATTRS
    PICASSO_SITE_ATTRS
    .SetShapeFn(TableGradsShape)
    .Doc(R"doc(
The gradients of the packed tables [num_rows[t], dims[t]] of a PicassoStitchedLookup
from the gradient of its output, whose columns hold the sites' gradients, read in
place. Per table, like PicassoPackedLookupGrad: ascending unique rows, summed rows.
)doc");

REGISTER_OP("PicassoStitchedLookupGradApply")
    .Input("grad: T")
    PICASSO_GRAD_APPLY_SIGNATURE
    PICASSO_STITCH_ATTRS
    PICASSO_SITE_ATTRS
    PICASSO_IN_PLACE_UPDATE_ATTRS
    .SetIsStateful()
    .SetShapeFn(shape_inference::NoOutputs)
    .Doc(R"doc(
PicassoStitchedLookupGrad with the tables' gradients applied in place by an
optimizer (sparse_updates.h) instead of returned: vars are the G tables' variables
[num_rows[t], dims[t]], slots their optimizer slots table by table (num_slots each,
in the order the PicassoSparseApply op of `optimizer` takes them), hyper that op's
scalar inputs in the order of hyper_names. Only the rows with a gradient are updated.
)doc");

#define REGISTER_PACKED_LOOKUP(T, Tid)                                                   \
  PICASSO_REGISTER_CPU_KERNEL("PicassoPackedLookup", T, Tid, PackedLookupOp<T, Tid>);     \
  PICASSO_REGISTER_CPU_KERNEL("PicassoPackedLookupGrad", T, Tid,                          \
                              PackedLookupGradOp<T, Tid, false>);                         \
  PICASSO_REGISTER_CPU_KERNEL("PicassoStitchedLookup", T, Tid, StitchedLookupOp<T, Tid>); \
  PICASSO_REGISTER_CPU_KERNEL("PicassoStitchedLookupGrad", T, Tid,                        \
                              PackedLookupGradOp<T, Tid, true>);                          \
  PICASSO_REGISTER_CPU_KERNEL("PicassoPackedLookupGradApply", T, Tid,                     \
                              LookupGradApplyOp<T, Tid, false>);                          \
  PICASSO_REGISTER_CPU_KERNEL("PicassoStitchedLookupGradApply", T, Tid,                   \
                              LookupGradApplyOp<T, Tid, true>);
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
