// Stitched projections (CPU kernels): a stitched lookup (PicassoStitchedLookup's
// layout of sites in the columns of a [rows, width] tensor) times a kernel
// [width, units], computed from the tables' rows without building the lookup.
//
//   PicassoStitchedProjection           the product.
//   PicassoStitchedProjectionGrad       per table, ascending unique rows and their
//                                       summed gradient rows; the kernel's gradient.
//   PicassoStitchedProjectionGradApply  the same gradient, each table's rows given
//                                       straight to an optimizer's update
//                                       (sparse_updates.h); returns the kernel's.
// GCC 12 warns inside its own AVX-512 intrinsics as Eigen's matrix product inlines them
// (GCC bug 105593, a false positive fixed in GCC 13).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#define EIGEN_USE_THREADS  // before any Eigen header: variable updates run on the CPU device

#include <type_traits>

#include "packed_sites.h"
#include "sparse_updates.h"
#include "tensorflow/core/framework/op.h"

namespace tensorflow {
namespace {

constexpr char kProjectionOp[] = "PicassoStitchedProjection";
constexpr char kProjectionGradOp[] = "PicassoStitchedProjectionGrad";
constexpr char kProjectionGradApplyOp[] = "PicassoStitchedProjectionGradApply";

// ---------------------------------------------------------------------------------
// PicassoStitchedProjection

// A stitched lookup that feeds only a MatMul is folded into it, so the stitched
// [rows, width] tensor is never written, nor its gradient read back. With a narrow
// kernel (a logistic regression, the wide part of a model) each output row is the sum
// over the sites of their rows' dot products with the kernel rows of their columns;
// a wider kernel (an MLP's first layer) is multiplied per unique row (further below).

// Outputs of a narrow projection: at most this many.
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

// How many rows ahead the projection prefetches: about 12 KB, 16 to 96 rows. It does
// one dot product per row, less work than the loops PrefetchDistance was measured on,
// so a row must be asked for earlier to arrive in time: this machine's memory answers
// more misses at once than a shorter distance asks for (benchmarks/memory_floor.py;
// docs/benchmarks.md, "The projection's prefetch distance").
constexpr int64_t ProjectionPrefetchDistance(int64_t row_bytes) {
  return std::clamp<int64_t>(12288 / std::max<int64_t>(row_bytes, 1), 16, 96);
}

// Adds site s's share of output rows [r0, r1) to y [rows, units]: for each of its
// rows (pooled: segments) landing there, the row's dot products with the kernel.
// False on a bad id.
template <int64_t kD, typename T, typename Tid>
bool ProjectSite(const Site<T, Tid> s, const SegmentIndex index, const T* table, int64_t d,
                 const KernelSlice<T> k, int64_t r0, int64_t r1, T* y) {
  const T* base = table + s.offset * d;
  const int64_t row_bytes = d * sizeof(T);
  const int64_t ahead = ProjectionPrefetchDistance(row_bytes);
  const int64_t begin = r0 * k.blocks, end = r1 * k.blocks;
  T sums[kMaxProjectionUnits];
  if (!s.pooled) {
    // One id per output row (one-hot, the usual case) needs no division per id to find
    // its output row and kernel weights.
    auto walk = [&](auto one_hot) {
      for (int64_t j = begin; j < end; ++j) {
        if (j + ahead < end) PrefetchBytes(RowAddress(base, s.ids[j + ahead], d), row_bytes);
        const Tid id = s.ids[j];
        if (!s.Valid(id)) return false;
        const T* row = base + static_cast<int64_t>(id) * d;
        T* out = y + (one_hot ? j : j / k.blocks) * k.units;
        const T* w = k.weights(0, one_hot ? 0 : j, d);
        for (int64_t p = 0; p < k.units; ++p) out[p] += DotRow<kD>(row, w + p * k.width, d);
      }
      return true;
    };
    return k.blocks == 1 ? walk(std::true_type{}) : walk(std::false_type{});
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

// values [rows.size(), d] = those rows of table, prefetched ahead (scattered over a
// table that is mostly not in cache).
template <typename T>
void GatherRows(const T* table, const std::vector<int64_t>& rows, int64_t d, T* values) {
  const int64_t n = static_cast<int64_t>(rows.size());
  const int64_t ahead = PrefetchDistance(d * sizeof(T));
  for (int64_t u = 0; u < n; ++u) {
    if (u + ahead < n) PrefetchBytes(table + rows[u + ahead] * d, d * sizeof(T));
    std::copy_n(table + rows[u] * d, d, values + u * d);
  }
}

// Checks what the projection ops take: no per-id weights, a [width, units] kernel
// with at least one unit, and sites that fit the stitched columns without
// overlapping, in `rows` rows.
template <typename T, typename Tid>
Status CheckProjection(const char* op, const PackedLayout& layout, const StitchLayout& stitch,
                       const std::vector<Site<T, Tid>>& sites, const std::vector<int64_t>& dims,
                       const Tensor& kernel, int64_t width, int64_t rows) {
  if (!TensorShapeUtils::IsMatrix(kernel.shape()) || kernel.dim_size(0) != width ||
      kernel.dim_size(1) < 1) {
    return errors::InvalidArgument(op, ": kernel must be [width ", width,
                                   ", units] with at least one unit; got ",
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

// Checks a projection gradient's dy: [rows, units] with the kernel's units.
Status CheckUpstream(const char* op, const Tensor& dy, const Tensor& kernel) {
  const bool matches = TensorShapeUtils::IsMatrix(dy.shape()) &&
                       (kernel.dims() != 2 || dy.dim_size(1) == kernel.dim_size(1));
  if (!matches) {  // (a kernel that is no matrix is CheckProjection's to name)
    return errors::InvalidArgument(op, ": grad must be [rows, units] with the kernel's units; ",
                                   "got ", dy.shape().DebugString(), " and kernel ",
                                   kernel.shape().DebugString());
  }
  return OkStatus();
}

// ---------------------------------------------------------------------------------
// The product with a wide kernel, per unique row

// A wider kernel (an MLP's first layer) is multiplied per unique row rather than per
// entry: for a site (and sequence slot) and each unique row u of its cluster, z_u =
// table[u] times the site's d kernel rows, then each output row adds the z rows of
// its entries. Ids repeat in a batch (under Zipf 1.2 a batch of 4096 draws about 1,000
// distinct ids per field), so this is a fraction of a MatMul's work on the stitched
// lookup, and the [rows, width] lookup is never written.
//
// Output columns go in blocks of kBlockPackets packets (64 floats with AVX-512). An
// output row's block stays in registers while the z rows of a band of sites are added
// to it, so it is read and written once per band rather than once per site.

using ::picasso::kLanes;
using ::picasso::Packet;
constexpr int kBlockPackets = 4;
template <typename T>
constexpr int64_t kBlockColumns = kBlockPackets * kLanes<T>;
// A band's z rows take at most this many bytes, so that they stay in cache (fewer
// bands, each adding more sites per pass over the output, measured no faster).
constexpr int64_t kBandBytes = 2 << 20;

// z[0, kRows) = e[0, kRows) w: kRows rows of e [., d] times w [d, kBlockColumns], each
// w row loaded once for all kRows rows.
template <int kRows, int64_t kD, typename T>
inline void ProductRows(const T* e, int64_t d, const T* w, T* z) {
  using Eigen::internal::pmadd;
  using Eigen::internal::pset1;
  using Eigen::internal::ploadu;
  using P = Packet<T>;
  constexpr int64_t kL = kLanes<T>, kC = kBlockColumns<T>;
  const int64_t n = kD ? kD : d;
  P acc[kRows][kBlockPackets];
  for (auto& row : acc) {
    for (P& a : row) a = pset1<P>(T(0));
  }
  for (int64_t k = 0; k < n; ++k) {
    P wk[kBlockPackets];
    for (int v = 0; v < kBlockPackets; ++v) wk[v] = ploadu<P>(w + k * kC + v * kL);
    for (int r = 0; r < kRows; ++r) {
      const P er = pset1<P>(e[r * n + k]);
      for (int v = 0; v < kBlockPackets; ++v) acc[r][v] = pmadd(er, wk[v], acc[r][v]);
    }
  }
  for (int r = 0; r < kRows; ++r) {
    for (int v = 0; v < kBlockPackets; ++v) {
      Eigen::internal::pstoreu(z + r * kC + v * kL, acc[r][v]);
    }
  }
}

// z [num_unique, kBlockColumns] = e [num_unique, d] w [d, kBlockColumns].
template <int64_t kD, typename T>
void BlockProducts(const T* e, int64_t num_unique, int64_t d, const T* w, T* z) {
  // As many rows as the vector registers hold accumulators for, next to the kernel
  // row's packets and a broadcast: 6 with AVX-512 (measured faster than 4), 2 with AVX2.
  constexpr int kRows = std::max(
      1, (EIGEN_ARCH_DEFAULT_NUMBER_OF_REGISTERS - kBlockPackets - 1) / kBlockPackets);
  constexpr int64_t kC = kBlockColumns<T>;
  int64_t u = 0;
  for (; u + kRows <= num_unique; u += kRows) ProductRows<kRows, kD>(e + u * d, d, w, z + u * kC);
  for (; u < num_unique; ++u) ProductRows<1, kD>(e + u * d, d, w, z + u * kC);
}

// One unpooled site (and slot) of a band: its z rows [unique rows of its cluster,
// kBlockColumns] and its entries' unique rows; output row r takes entry r * blocks + slot.
template <typename T>
struct BandSite {
  const T* z;
  const uint32_t* inverse;
  int64_t blocks, slot;
};

// Adds the z rows of the band's sites to columns [0, columns) of output rows [r0, r1)
// of y (row stride `units`).
template <typename T>
void AddBand(const std::vector<BandSite<T>>& band, int64_t r0, int64_t r1, int64_t units,
             int64_t columns, T* y) {
  using Eigen::internal::padd;
  using Eigen::internal::ploadu;
  using Eigen::internal::pstoreu;
  using P = Packet<T>;
  constexpr int64_t kL = kLanes<T>, kC = kBlockColumns<T>;
  T partial[kC] = {};  // a block narrower than kC, padded
  for (int64_t r = r0; r < r1; ++r) {
    T* out = y + r * units;
    T* in = columns == kC ? out : partial;
    if (in == partial) std::copy_n(out, columns, partial);
    P acc[kBlockPackets];
    for (int v = 0; v < kBlockPackets; ++v) acc[v] = ploadu<P>(in + v * kL);
    for (const BandSite<T>& b : band) {
      const T* z = b.z + b.inverse[r * b.blocks + b.slot] * kC;
      for (int v = 0; v < kBlockPackets; ++v) acc[v] = padd(acc[v], ploadu<P>(z + v * kL));
    }
    for (int v = 0; v < kBlockPackets; ++v) pstoreu(in + v * kL, acc[v]);
    if (in == partial) std::copy_n(partial, columns, out);
  }
}

// Adds scale * z row of each entry of pooled site s in slot `slot` to its output row
// (segment / blocks) in [r0, r1), columns [0, columns) of y.
template <typename T, typename Tid>
void AddPooled(const Site<T, Tid>& s, int64_t blocks, int64_t slot, const T* scales,
               const uint32_t* inverse, const T* z, int64_t r0, int64_t r1, int64_t units,
               int64_t columns, T* y) {
  constexpr int64_t kC = kBlockColumns<T>;
  for (int64_t j = 0; j < s.n; ++j) {
    const int64_t seg = s.segments[j], row = seg / blocks;
    if (seg % blocks != slot || row < r0 || row >= r1) continue;
    const T scale = scales ? scales[seg] : T(1);
    if (columns == kC) {
      AxpyRow<kC>(y + row * units, z + inverse[j] * kC, scale, kC);
    } else {
      AxpyRow<0>(y + row * units, z + inverse[j] * kC, scale, columns);
    }
  }
}

// The gradients of a projection from dy [rows, units]: each table's row-sparse
// gradient and the kernel's. For a site and each unique row u of its cluster, the
// entries' upstream rows are first summed, s_u = sum of scale * dy[row] (units
// values), then row u's gradient gains kernel slice * s_u and the kernel slice gains
// table[u] * s_u: one pass over the ids, then work per unique row only (a dense
// gradient would do that work per entry). A cluster is one work item; its sites'
// kernel columns are its own, so every sum has one order.

// Fills sums [unique rows, units] with s_u for the entries of site s in row block
// `slot` (inverse: each entry's unique row).
template <typename T, typename Tid>
void SumUpstream(const Site<T, Tid>& s, int64_t blocks, int64_t slot, const T* scales,
                 const uint32_t* inverse, const T* dy, int64_t units, T* sums) {
  if (s.pooled) {
    for (int64_t j = 0; j < s.n; ++j) {
      const int64_t seg = s.segments[j];
      if (seg % blocks != slot) continue;
      const T scale = scales ? scales[seg] : T(1);
      const T* g = dy + (seg / blocks) * units;
      T* sum = sums + inverse[j] * units;
      for (int64_t p = 0; p < units; ++p) sum[p] += scale * g[p];
    }
    return;
  }
  for (int64_t j = slot; j < s.n; j += blocks) {
    const T* g = dy + (j / blocks) * units;
    T* sum = sums + inverse[j] * units;
    for (int64_t p = 0; p < units; ++p) sum[p] += g[p];
  }
}

// GroupDense's hooks for a cluster of one one-hot site in one row block: its sums
// s_u (as SumUpstream's, in the same order) added up per row while the rows are
// marked, in by_row [rows of the cluster, units] (all zero between calls, each call
// clearing the rows it read), then copied out per unique row into sums (room for one
// row per entry). Saves SumUpstream's pass over the ids and GroupDense's pass writing
// the inverse.
template <typename T>
struct SumWhileGrouping {
  static constexpr bool kInverse = false;
  const T* dy;
  int64_t units;
  T* by_row;
  T* sums;

  void Entry(int64_t entry, int64_t row) {
    const T* g = dy + entry * units;
    T* sum = by_row + row * units;
    for (int64_t p = 0; p < units; ++p) sum[p] += g[p];
  }
  void Row(int64_t u, int64_t row) {
    T* sum = by_row + row * units;
    T* out = sums + u * units;
    for (int64_t p = 0; p < units; ++p) {
      out[p] = sum[p];
      sum[p] = T(0);
    }
  }
};

// A narrow kernel (at most kMaxProjectionUnits units, kept transposed in kt/dkt):
// per unique row and unit, one axpy into its gradient and one into the kernel's; for
// unique rows [u0, u1). Rows are prefetched ahead (past u1 too: the next block's), and
// prefetch_slots(row) asks for what an optimizer will read of them besides.
template <int64_t kD, typename T, typename PrefetchFn>
void NarrowRowGrads(const KernelSlice<T>& slice, int64_t slot, const T* sums,
                    const std::vector<int64_t>& rows, const T* table, int64_t d, T* out, T* dkt,
                    int64_t u0, int64_t u1, const PrefetchFn& prefetch_slots) {
  const int64_t units = slice.units, num_unique = static_cast<int64_t>(rows.size());
  const int64_t ahead = PrefetchDistance(d * sizeof(T));
  for (int64_t u = u0; u < u1; ++u) {
    if (u + ahead < num_unique) {
      PrefetchBytes(table + rows[u + ahead] * d, d * sizeof(T));
      PrefetchBytes(out + (u + ahead) * d, d * sizeof(T));
      prefetch_slots(rows[u + ahead]);
    }
    const T* sum = sums + u * units;
    const T* row = table + rows[u] * d;
    for (int64_t p = 0; p < units; ++p) {
      if (sum[p] == T(0)) continue;
      AxpyRow<kD>(out + u * d, slice.weights(p, slot, d), sum[p], d);
      AxpyRow<kD>(dkt + slice.offset(p, slot, d), row, sum[p], d);
    }
  }
}

// A cluster read by one site in one row block has each unique row's gradient final as
// soon as NarrowRowGrads is past it, so it is handed on in blocks of this many rows:
// an optimizer then updates them while their rows (and the slots' rows, prefetched
// beside them) are in cache, instead of missing on them again in a second pass.
constexpr int64_t kFinalRowsBlock = 256;

// A wide kernel, fused: the entries of a site (and slot) ordered by unique row, then
// per block of kGradRows unique rows their sums s_u added up in registers (into a
// buffer that stays in L1), row u's gradient gaining the dot products of s_u with the
// slot's d kernel rows and those rows' gradient gaining table[u] * s_u. S is never
// written whole, nor packed for a matrix product.
constexpr int kGradRows = 8;

// The entries of a site in one slot, ordered by unique row: row u's are
// [starts[u], starts[u + 1]) of `rows` (each entry's dy row) and of `scales` (mean and
// sqrtn sites only; else empty), in ascending entry order.
template <typename T>
struct EntriesByRow {
  std::vector<uint32_t> starts, rows, next;
  std::vector<T> scales;

  template <typename Tid>
  void Build(const Site<T, Tid>& s, int64_t blocks, int64_t slot, const T* segment_scales,
             const uint32_t* inverse, int64_t num_unique) {
    // Calls fn(local entry, dy row, scale) for the slot's entries in order.
    auto visit = [&](const auto& fn) {
      if (!s.pooled) {
        for (int64_t j = slot; j < s.n; j += blocks) fn(j, j / blocks, T(1));
        return;
      }
      for (int64_t j = 0; j < s.n; ++j) {
        const int64_t seg = s.segments[j];
        if (seg % blocks == slot) fn(j, seg / blocks, segment_scales ? segment_scales[seg] : T(1));
      }
    };
    starts.assign(num_unique + 1, 0);
    visit([&](int64_t j, int64_t, T) { ++starts[inverse[j] + 1]; });
    for (int64_t u = 0; u < num_unique; ++u) starts[u + 1] += starts[u];
    rows.resize(starts[num_unique]);
    scales.resize(segment_scales ? rows.size() : 0);
    next.assign(starts.begin(), starts.end() - 1);
    visit([&](int64_t j, int64_t row, T scale) {
      const uint32_t p = next[inverse[j]]++;
      rows[p] = static_cast<uint32_t>(row);
      if (segment_scales) scales[p] = scale;
    });
  }
};

// sum [units] = the (scaled) dy rows of entries [first, last) of `entries`, a block of
// columns at a time in registers.
template <typename T>
void SumEntries(const EntriesByRow<T>& entries, int64_t first, int64_t last, const T* dy,
                int64_t units, T* sum) {
  using Eigen::internal::padd;
  using Eigen::internal::pmadd;
  using Eigen::internal::ploadu;
  using Eigen::internal::pset1;
  using P = Packet<T>;
  constexpr int64_t kL = kLanes<T>, kC = kBlockColumns<T>;
  const uint32_t* rows = entries.rows.data();
  const T* scales = entries.scales.empty() ? nullptr : entries.scales.data();
  const int64_t full = units / kC * kC;
  for (int64_t c0 = 0; c0 < full; c0 += kC) {
    P acc[kBlockPackets];
    for (P& a : acc) a = pset1<P>(T(0));
    for (int64_t e = first; e < last; ++e) {
      const T* g = dy + rows[e] * units + c0;
      if (scales) {
        const P scale = pset1<P>(scales[e]);
        for (int v = 0; v < kBlockPackets; ++v) {
          acc[v] = pmadd(scale, ploadu<P>(g + v * kL), acc[v]);
        }
      } else {
        for (int v = 0; v < kBlockPackets; ++v) acc[v] = padd(acc[v], ploadu<P>(g + v * kL));
      }
    }
    for (int v = 0; v < kBlockPackets; ++v) Eigen::internal::pstoreu(sum + c0 + v * kL, acc[v]);
  }
  for (int64_t p = full; p < units; ++p) {
    T total = T(0);
    for (int64_t e = first; e < last; ++e) {
      total += (scales ? scales[e] : T(1)) * dy[rows[e] * units + p];
    }
    sum[p] = total;
  }
}

// out [kRows, d] += s [kRows, units] wt [units, d], d a multiple of kWidth: packets of
// kWidth lanes across d, each s value broadcast.
template <int kRows, int kWidth, typename T>
void DotsAcross(const T* s, const T* wt, int64_t d, int64_t units, T* out) {
  using Eigen::internal::pmadd;
  using Eigen::internal::pset1;
  using P = typename Eigen::internal::find_packet_by_size<T, kWidth>::type;
  for (int64_t i0 = 0; i0 < d; i0 += kWidth) {
    P acc[kRows];
    for (P& a : acc) a = pset1<P>(T(0));
    for (int64_t k = 0; k < units; ++k) {
      const P wk = Eigen::internal::ploadu<P>(wt + k * d + i0);
      for (int r = 0; r < kRows; ++r) acc[r] = pmadd(pset1<P>(s[r * units + k]), wk, acc[r]);
    }
    for (int r = 0; r < kRows; ++r) {
      T* o = out + r * d + i0;
      Eigen::internal::pstoreu(o, Eigen::internal::padd(Eigen::internal::ploadu<P>(o), acc[r]));
    }
  }
}

// The same with the widest packet (kWidth lanes or fewer) that divides d; for a d that
// none divides, one dot product per output, along units.
template <int kRows, int kWidth, typename T>
void Dots(const T* s, const T* wt, int64_t d, int64_t units, T* out) {
  if constexpr (kWidth > 1) {
    if constexpr (Eigen::internal::find_packet_by_size<T, kWidth>::value) {
      if (d % kWidth == 0) return DotsAcross<kRows, kWidth>(s, wt, d, units, out);
    }
    return Dots<kRows, kWidth / 2>(s, wt, d, units, out);
  } else {
    for (int r = 0; r < kRows; ++r) {
      for (int64_t i = 0; i < d; ++i) {
        T dot = T(0);
        for (int64_t k = 0; k < units; ++k) dot += s[r * units + k] * wt[k * d + i];
        out[r * d + i] += dot;
      }
    }
  }
}

// dw [d, units] += e^T s for kRows rows with values e [kRows, d] and sums s [kRows, units].
template <int kRows, typename T>
void KernelRowGrads(const T* s, const T* e, int64_t d, int64_t units, T* dw) {
  using Eigen::internal::pmadd;
  using Eigen::internal::ploadu;
  using Eigen::internal::pset1;
  using P = Packet<T>;
  constexpr int64_t kL = kLanes<T>, kC = kBlockColumns<T>;
  const int64_t full = units / kC * kC;
  for (int64_t c0 = 0; c0 < full; c0 += kC) {
    P sv[kRows][kBlockPackets];
    for (int r = 0; r < kRows; ++r) {
      for (int v = 0; v < kBlockPackets; ++v) sv[r][v] = ploadu<P>(s + r * units + c0 + v * kL);
    }
    for (int64_t i = 0; i < d; ++i) {
      T* dwi = dw + i * units + c0;
      P acc[kBlockPackets];
      for (int v = 0; v < kBlockPackets; ++v) acc[v] = ploadu<P>(dwi + v * kL);
      for (int r = 0; r < kRows; ++r) {
        const P er = pset1<P>(e[r * d + i]);
        for (int v = 0; v < kBlockPackets; ++v) acc[v] = pmadd(er, sv[r][v], acc[v]);
      }
      for (int v = 0; v < kBlockPackets; ++v) Eigen::internal::pstoreu(dwi + v * kL, acc[v]);
    }
  }
  for (int64_t c = full; c < units; ++c) {
    for (int64_t i = 0; i < d; ++i) {
      T total = dw[i * units + c];
      for (int r = 0; r < kRows; ++r) total += e[r * d + i] * s[r * units + c];
      dw[i * units + c] = total;
    }
  }
}

// The fused wide gradients of one site (and slot): values [unique rows, d] are the
// cluster's rows, wt the slot's d kernel rows transposed [units, d], dw their gradient
// [d, units].
template <typename T>
void WideSiteGrads(const EntriesByRow<T>& entries, const T* values, int64_t d, const T* dy,
                   int64_t units, const T* wt, T* out, T* dw) {
  constexpr int kHalf = kGradRows / 2;
  const int64_t num_unique = static_cast<int64_t>(entries.starts.size()) - 1;
  thread_local std::vector<T> sums;
  sums.resize(kGradRows * units);
  int64_t u = 0;
  for (; u + kGradRows <= num_unique; u += kGradRows) {
    for (int r = 0; r < kGradRows; ++r) {
      SumEntries(entries, entries.starts[u + r], entries.starts[u + r + 1], dy, units,
                 sums.data() + r * units);
    }
    Dots<kGradRows, kLanes<T>>(sums.data(), wt, d, units, out + u * d);
    // In two halves: a half's sums (kHalf x kBlockPackets packets) stay in registers.
    KernelRowGrads<kHalf>(sums.data(), values + u * d, d, units, dw);
    KernelRowGrads<kHalf>(sums.data() + kHalf * units, values + (u + kHalf) * d, d, units, dw);
  }
  for (; u < num_unique; ++u) {
    SumEntries(entries, entries.starts[u], entries.starts[u + 1], dy, units, sums.data());
    Dots<1, kLanes<T>>(sums.data(), wt, d, units, out + u * d);
    KernelRowGrads<1>(sums.data(), values + u * d, d, units, dw);
  }
}

// `out` receives the cluster's [unique rows, d] gradient; dk is the kernel's gradient
// (transposed for a narrow kernel, as kt). final(u0, n) is called as rows [u0, u0 + n)
// of out become final, in order, covering every row; prefetch_slots as in
// NarrowRowGrads. presummed: the cluster's sums when grouping made them
// (SumWhileGrouping), else null.
template <int64_t kD, typename T, typename Tid, typename FinalFn, typename PrefetchFn>
void ProjectClusterGrad(const std::vector<Site<T, Tid>>& sites,
                        const std::vector<KernelSlice<T>>& slices,
                        const std::vector<const T*>& scales, const RowClusters::Cluster& c,
                        const T* table, int64_t d, const T* dy, const T* kernel,
                        const T* presummed, T* out, T* dk, const FinalFn& final,
                        const PrefetchFn& prefetch_slots) {
  const int64_t num_unique = c.num_unique();
  const int64_t units = slices.empty() ? 0 : slices[0].units;
  const bool wide = units > kMaxProjectionUnits;
  thread_local std::vector<T> sums, values, wt;
  thread_local EntriesByRow<T> entries;
  if (!wide && c.sites.size() == 1 && slices[c.sites[0]].blocks == 1) {
    const int k = c.sites[0];
    if (presummed == nullptr) {
      sums.assign(num_unique * units, T(0));
      SumUpstream(sites[k], 1, 0, scales[k], c.inverse.get(), dy, units, sums.data());
      presummed = sums.data();
    }
    for (int64_t u0 = 0; u0 < num_unique; u0 += kFinalRowsBlock) {
      const int64_t u1 = std::min(num_unique, u0 + kFinalRowsBlock);
      std::fill(out + u0 * d, out + u1 * d, T(0));
      NarrowRowGrads<kD>(slices[k], 0, presummed, c.rows, table, d, out, dk, u0, u1,
                         prefetch_slots);
      final(u0, u1 - u0);
    }
    return;
  }
  std::fill(out, out + num_unique * d, T(0));
  if (wide) {
    values.resize(num_unique * d);
    GatherRows(table, c.rows, d, values.data());
  }
  for (size_t k = 0; k < c.sites.size(); ++k) {
    const Site<T, Tid>& s = sites[c.sites[k]];
    const KernelSlice<T>& slice = slices[c.sites[k]];
    const uint32_t* inverse = c.inverse.get() + c.site_begin[k];
    for (int64_t slot = 0; slot < slice.blocks; ++slot) {
      if (!wide) {
        sums.assign(num_unique * units, T(0));
        SumUpstream(s, slice.blocks, slot, scales[c.sites[k]], inverse, dy, units, sums.data());
        NarrowRowGrads<kD>(slice, slot, sums.data(), c.rows, table, d, out, dk, 0, num_unique,
                           [](int64_t) {});
        continue;
      }
      entries.Build(s, slice.blocks, slot, scales[c.sites[k]], inverse, num_unique);
      // The slot's kernel rows [d, units], transposed for Dots.
      const T* w = kernel + (slice.column + slot * d) * units;
      wt.resize(units * d);
      for (int64_t i = 0; i < d; ++i) {
        for (int64_t p = 0; p < units; ++p) wt[p * d + i] = w[i * units + p];
      }
      WideSiteGrads(entries, values.data(), d, dy, units, wt.data(), out,
                    dk + (w - kernel));
    }
  }
  final(0, num_unique);
}

// A projection worked per unique row of each table: the inputs checked and each
// table's entries grouped by row (Prepare), then a wide kernel's product (Forward), or
// from dy [rows, units] each cluster's row gradients and the kernel's gradient (Run,
// KernelGrad).
template <typename T, typename Tid>
class GroupedProjection {
 public:
  struct Table {
    std::vector<Site<T, Tid>> sites;
    std::vector<KernelSlice<T>> slices;
    std::vector<const T*> scales;
    RowClusters groups;
    // Per cluster, its sums if grouping made them (room for one row per entry), else null.
    std::vector<std::unique_ptr<T[]>> presummed;
    const T* values = nullptr;
    int64_t d = 0;
  };

  // `tables` holds the tables' values (anything indexable by table giving a Tensor);
  // the sites fill `rows` output rows. With dy (a gradient's upstream, [rows, units]),
  // the clusters of one one-hot site in one row block sum it while they are grouped.
  template <typename Tables>
  Status Prepare(OpKernelContext* ctx, const char* op, const ProjectionAttrs& attrs,
                 const Tables& tables, const Tensor& kernel, int64_t rows,
                 const T* dy = nullptr) {
    attrs_ = &attrs;
    const PackedLayout& layout = attrs.layout;
    std::vector<Site<T, Tid>> sites;
    // Its pooled loops read each entry's segment id.
    TF_RETURN_IF_ERROR(ReadSites(ctx, op, layout, &sites, /*write_row_segment_ids=*/true));
    std::vector<const T*> site_tables;
    std::vector<int64_t> dims;
    TF_RETURN_IF_ERROR(SiteTables(op, layout, attrs.table_index, tables, &sites, &site_tables, &dims));
    TF_RETURN_IF_ERROR(
        CheckProjection(op, layout, attrs.stitch, sites, dims, kernel, attrs.width, rows));
    rows_ = rows;
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
    // A narrow kernel is read transposed (see KernelSlice), a wide one as it is.
    kernel_ = kernel.flat<T>().data();
    if (units_ <= kMaxProjectionUnits) kt_ = Transposed(kernel_, attrs.width, units_);

    // Each table's entries grouped by row.
    tables_ = std::vector<Table>(attrs.by_table.sites.size());
    std::vector<SitesOfTable<Site<T, Tid>>> grouped;
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
      // A table has at most one cluster per site.
      g.presummed.resize(g.sites.size());
      grouped.push_back({&attrs.by_table.layouts[t], &g.sites, &g.groups});
    }
    return GroupTablesByRow(ctx, op, grouped,
                            [&](int t, int64_t index, RowClusters::Cluster* c) {
                              return GroupCluster(tables_[t], dy, index, c);
                            });
  }

  const std::vector<Table>& tables() const { return tables_; }

  // y [rows, units] = the product, per unique row (for a wide kernel). Items are
  // blocks of output columns times blocks of rows (more row blocks when there are
  // few column blocks: each recomputes its z rows). Sites are added in one order.
  void Forward(OpKernelContext* ctx, T* y) const {
    constexpr int64_t kC = kBlockColumns<T>;
    const bool parallel = Parallel();
    std::vector<std::vector<T>> gathered;
    const std::vector<Part> parts = Parts(ctx, parallel, &gathered);
    const int64_t column_blocks = (units_ + kC - 1) / kC;
    const int64_t row_blocks = std::clamp<int64_t>(NumThreads(ctx) / column_blocks, 1,
                                                   std::max<int64_t>(1, rows_ / 256));
    const int64_t block_rows = (rows_ + row_blocks - 1) / row_blocks;
    std::fill(y, y + rows_ * units_, T(0));
    RunWorkItems(ctx, column_blocks * row_blocks, parallel, [&](int64_t item) {
      const int64_t c0 = (item / row_blocks) * kC, r0 = (item % row_blocks) * block_rows;
      AddParts(parts, c0, std::min(units_ - c0, kC), r0, std::min(rows_, r0 + block_rows), y);
    });
  }

  // Computes each cluster's row gradients into out(t, cluster), a [unique rows, d] buffer,
  // calling done(t, cluster, u0, n, rows [u0, u0 + n) of that buffer) as they become
  // final (ProjectClusterGrad), on one thread per cluster: clusters of one table cover
  // disjoint rows. prefetch_slots(t, row) asks for what done will read of table t's row
  // besides the row itself.
  template <typename OutFn, typename DoneFn, typename PrefetchFn>
  void Run(OpKernelContext* ctx, const T* dy, const OutFn& out, const DoneFn& done,
           const PrefetchFn& prefetch_slots) {
    dk_.assign(units_ * attrs_->width, T(0));
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
        ProjectClusterGrad<decltype(dim)::value>(
            g.sites, g.slices, g.scales, c, g.values, g.d, dy, kernel_,
            g.presummed[items[k].second].get(), grads, dk_.data(),
            [&](int64_t u0, int64_t n) { done(t, c, u0, n, grads + u0 * g.d); },
            [&](int64_t row) { prefetch_slots(t, row); });
      });
    });
  }

  // The kernel's gradient, once Run is done.
  Status KernelGrad(OpKernelContext* ctx) const {
    Tensor* kernel_grad;
    TF_RETURN_IF_ERROR(ctx->allocate_output("kernel_grad", ctx->input(1).shape(), &kernel_grad));
    T* dk = kernel_grad->flat<T>().data();
    const int64_t width = attrs_->width;
    if (units_ > kMaxProjectionUnits) {
      std::copy(dk_.begin(), dk_.end(), dk);
      return OkStatus();
    }
    for (int64_t c = 0; c < width; ++c) {
      for (int64_t p = 0; p < units_; ++p) dk[c * units_ + p] = dk_[p * width + c];
    }
    return OkStatus();
  }

 private:
  // Groups a densely grouped cluster of table g, summing dy while it does where
  // ProjectClusterGrad would sum it per site afterwards (SumWhileGrouping).
  bool GroupCluster(Table& g, const T* dy, int64_t index, RowClusters::Cluster* c) const {
    const bool one_hot_site = c->sites.size() == 1 && !g.sites[c->sites[0]].pooled &&
                              g.slices[c->sites[0]].blocks == 1;
    const int64_t by_row_size = (c->hi - c->lo) * units_;
    if (dy == nullptr || !one_hot_site || units_ > kMaxProjectionUnits ||
        by_row_size > kKeptDenseRows) {
      return GroupDense(g.sites, c);
    }
    // All zero between calls; kept, as GroupDense's scratch, up to kKeptDenseRows values.
    thread_local std::vector<T> by_row;
    if (static_cast<int64_t>(by_row.size()) < by_row_size) by_row.resize(by_row_size, T(0));
    std::unique_ptr<T[]> sums(new T[c->num_entries() * units_]);
    if (GroupDense(g.sites, c, SumWhileGrouping<T>{dy, units_, by_row.data(), sums.get()})) {
      g.presummed[index] = std::move(sums);
      return true;
    }
    std::fill(by_row.begin(), by_row.begin() + by_row_size, T(0));  // a bad id: rows were summed
    return false;
  }

  const ProjectionAttrs* attrs_ = nullptr;
  // What Forward adds to the output: a site (and sequence slot) with its cluster's
  // unique rows' values [unique rows, d].
  struct Part {
    const Table* table;
    const RowClusters::Cluster* cluster;
    int k;  // the site's index in the cluster
    int64_t slot;
    const T* values;

    const Site<T, Tid>& site() const { return table->sites[cluster->sites[k]]; }
    const KernelSlice<T>& slice() const { return table->slices[cluster->sites[k]]; }
    const T* scales() const { return table->scales[cluster->sites[k]]; }
    const uint32_t* inverse() const { return cluster->inverse.get() + cluster->site_begin[k]; }
  };

  // Whether the work is large enough to pay for waking threads.
  bool Parallel() const {
    int64_t entries = 0;
    for (const Table& g : tables_) {
      for (const auto& c : g.groups.clusters) entries += c.num_entries();
    }
    return entries * units_ * sizeof(T) >= kMinParallelBytes;
  }

  // The parts in order, each cluster's unique rows gathered (once, into `gathered`).
  std::vector<Part> Parts(OpKernelContext* ctx, bool parallel,
                          std::vector<std::vector<T>>* gathered) const {
    std::vector<std::pair<const Table*, const RowClusters::Cluster*>> clusters;
    for (const Table& g : tables_) {
      for (const auto& c : g.groups.clusters) clusters.push_back({&g, &c});
    }
    gathered->assign(clusters.size(), {});
    RunWorkItems(ctx, clusters.size(), parallel, [&](int64_t k) {
      const auto& [g, c] = clusters[k];
      std::vector<T>& values = (*gathered)[k];
      values.resize(c->num_unique() * g->d);
      GatherRows(g->values, c->rows, g->d, values.data());
    });
    std::vector<Part> parts;
    for (size_t k = 0; k < clusters.size(); ++k) {
      const auto& [g, c] = clusters[k];
      for (size_t i = 0; i < c->sites.size(); ++i) {
        for (int64_t slot = 0; slot < g->slices[c->sites[i]].blocks; ++slot) {
          parts.push_back({g, c, static_cast<int>(i), slot, (*gathered)[k].data()});
        }
      }
    }
    return parts;
  }

  // Adds every part's products to columns [c0, c0 + columns) of output rows [r0, r1),
  // a band at a time: one pooled part, or consecutive unpooled ones whose z rows fit.
  void AddParts(const std::vector<Part>& parts, int64_t c0, int64_t columns, int64_t r0,
                int64_t r1, T* y) const {
    constexpr int64_t kC = kBlockColumns<T>;
    thread_local std::vector<T> w, z;
    std::vector<BandSite<T>> band;
    for (size_t i = 0; i < parts.size() && r0 < r1;) {
      size_t end = i + 1;
      int64_t size = parts[i].cluster->num_unique() * kC;
      while (!parts[i].site().pooled && end < parts.size() && !parts[end].site().pooled &&
             (size + parts[end].cluster->num_unique() * kC) * sizeof(T) <= kBandBytes) {
        size += parts[end++].cluster->num_unique() * kC;
      }
      z.resize(std::max<size_t>(z.size(), size));
      band.clear();
      for (size_t k = i, offset = 0; k < end; offset += parts[k++].cluster->num_unique() * kC) {
        const Part& p = parts[k];
        const int64_t d = p.table->d;
        // The part's kernel rows, this block's columns, padded to kC.
        w.assign(d * kC, T(0));
        const T* kernel_rows = kernel_ + (p.slice().column + p.slot * d) * units_ + c0;
        for (int64_t r = 0; r < d; ++r) std::copy_n(kernel_rows + r * units_, columns, &w[r * kC]);
        DispatchDim(d, [&](auto dim) {
          BlockProducts<decltype(dim)::value>(p.values, p.cluster->num_unique(), d, w.data(),
                                              z.data() + offset);
        });
        band.push_back({z.data() + offset, p.inverse(), p.slice().blocks, p.slot});
      }
      if (parts[i].site().pooled) {
        const Part& p = parts[i];
        AddPooled(p.site(), band[0].blocks, p.slot, p.scales(), band[0].inverse, band[0].z, r0, r1,
                  units_, columns, y + c0);
      } else {
        AddBand(band, r0, r1, units_, columns, y + c0);
      }
      i = end;
    }
  }

  int64_t rows_ = 0, units_ = 0;
  std::vector<std::vector<T>> scale_buffers_;
  const T* kernel_ = nullptr;
  std::vector<T> kt_, dk_;   // kt_: a narrow kernel transposed; dk_: as kt_ if narrow
  std::vector<Table> tables_;
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
    const Tensor& kernel = ctx->input(ctx->num_inputs() - 1);
    const int64_t rows = sites[0].out_rows() / attrs_.stitch.row_blocks[0];
    Tensor* output;
    if (kernel.dims() == 2 && kernel.dim_size(1) > kMaxProjectionUnits) {
      GroupedProjection<T, Tid> wide;  // checks the inputs as it groups them
      OP_REQUIRES_OK(ctx, wide.Prepare(ctx, kProjectionOp, attrs_, tables, kernel, rows));
      OP_REQUIRES_OK(ctx, ctx->allocate_output("output", TensorShape({rows, kernel.dim_size(1)}),
                                               &output));
      wide.Forward(ctx, output->flat<T>().data());
      return;
    }
    std::vector<const T*> site_tables;
    std::vector<int64_t> dims;
    OP_REQUIRES_OK(ctx, SiteTables(kProjectionOp, layout, attrs_.table_index, tables, &sites,
                                   &site_tables, &dims));
    OP_REQUIRES_OK(ctx, CheckProjection(kProjectionOp, layout, attrs_.stitch, sites, dims,
                                        kernel, attrs_.width, rows));
    const int64_t units = kernel.dim_size(1);
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

template <typename T, typename Tid>
class StitchedProjectionGradOp : public OpKernel {
 public:
  explicit StitchedProjectionGradOp(OpKernelConstruction* c) : OpKernel(c) {
    OP_REQUIRES_OK(c, attrs_.Init(c, kProjectionGradOp));
  }

  void Compute(OpKernelContext* ctx) override {
    OpInputList tables;
    OP_REQUIRES_OK(ctx, ctx->input_list("tables", &tables));
    const Tensor& dy = ctx->input(0);
    OP_REQUIRES_OK(ctx, CheckUpstream(kProjectionGradOp, dy, ctx->input(1)));
    GroupedProjection<T, Tid> gradient;
    OP_REQUIRES_OK(ctx, gradient.Prepare(ctx, kProjectionGradOp, attrs_, tables, ctx->input(1),
                                         dy.dim_size(0), dy.flat<T>().data()));
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
        ctx, dy.flat<T>().data(),
        [&](int t, const RowClusters::Cluster& c) {
          return row_grads[t] + c.unique_begin * gradient.tables()[t].d;
        },
        [](int, const RowClusters::Cluster&, int64_t, int64_t, const T*) {},
        [](int, int64_t) {});
    OP_REQUIRES_OK(ctx, gradient.KernelGrad(ctx));
  }

 private:
  ProjectionAttrs attrs_;
};

// The projection's gradient applied by an optimizer to the tables in place: each
// cluster's row gradients go to the optimizer's update of those rows (their table
// rows still in cache from the kernel gradient; a narrow one-site cluster's block by
// block, its slots' rows prefetched with them) instead of to an output, and only the
// kernel's gradient is returned. Rows without a gradient are left alone (the lazy
// form, which is Keras' own for Adagrad and momentum-free SGD). Each table row's value
// is read for the kernel gradient before the update of that row.
template <typename T, typename Tid>
class StitchedProjectionGradApplyOp : public OpKernel {
 public:
  explicit StitchedProjectionGradApplyOp(OpKernelConstruction* c) : OpKernel(c), updates_(c) {
    OP_REQUIRES_OK(c, attrs_.Init(c, kProjectionGradApplyOp));
  }

  void Compute(OpKernelContext* ctx) override {
    typename picasso::InPlaceUpdates<T>::Locked vars;
    OP_REQUIRES_OK(ctx, vars.Lock(ctx, updates_));
    const Tensor& dy = ctx->input(0);
    OP_REQUIRES_OK(ctx, CheckUpstream(kProjectionGradApplyOp, dy, ctx->input(1)));
    GroupedProjection<T, Tid> gradient;
    OP_REQUIRES_OK(ctx, gradient.Prepare(ctx, kProjectionGradApplyOp, attrs_, vars.tensors(),
                                         ctx->input(1), dy.dim_size(0), dy.flat<T>().data()));
    OP_REQUIRES_OK(ctx, vars.Run(ctx, [&](const auto& apply) {
      gradient.Run(
          ctx, dy.flat<T>().data(),
          [&](int t, const RowClusters::Cluster& c) {
            thread_local std::vector<T> buffer;
            buffer.resize(c.num_unique() * vars.tensors()[t].dim_size(1));
            return buffer.data();
          },
          [&](int t, const RowClusters::Cluster& c, int64_t u0, int64_t n, const T* grads) {
            apply(t, c.rows.data() + u0, n, grads);
          },
          [&](int t, int64_t row) { vars.PrefetchSlots(t, row); });
    }));
    OP_REQUIRES_OK(ctx, gradient.KernelGrad(ctx));
  }

 private:
  ProjectionAttrs attrs_;
  picasso::InPlaceUpdates<T> updates_;
};

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

}  // namespace

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
    PICASSO_STITCH_ATTRS
    PICASSO_SITE_ATTRS
    .SetShapeFn(ProjectionShape)
    .Doc(R"doc(
The product of a stitched lookup (as PicassoStitchedLookup lays out its sites, in
columns of a [rows, width] tensor) with kernel [width, units], without building the
lookup, as output [rows, units]. With more than 8 units it is computed per unique
row of each table. Columns no site covers contribute
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
    PICASSO_STITCH_ATTRS
    PICASSO_SITE_ATTRS
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
    PICASSO_STITCH_ATTRS
    PICASSO_SITE_ATTRS
    PICASSO_IN_PLACE_UPDATE_ATTRS
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

#define REGISTER_PROJECTION(T, Tid)                                                      \
  PICASSO_REGISTER_CPU_KERNEL("PicassoStitchedProjection", T, Tid,                        \
                              StitchedProjectionOp<T, Tid>);                              \
  PICASSO_REGISTER_CPU_KERNEL("PicassoStitchedProjectionGrad", T, Tid,                    \
                              StitchedProjectionGradOp<T, Tid>);                          \
  PICASSO_REGISTER_CPU_KERNEL("PicassoStitchedProjectionGradApply", T, Tid,               \
                              StitchedProjectionGradApplyOp<T, Tid>);
REGISTER_PROJECTION(float, int32_t)
REGISTER_PROJECTION(float, int64_t)
REGISTER_PROJECTION(double, int32_t)
REGISTER_PROJECTION(double, int64_t)
#undef REGISTER_PROJECTION

}  // namespace tensorflow
