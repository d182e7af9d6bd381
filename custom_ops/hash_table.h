// The cold tier of HybridHash: a DRAM hash map from int64 key to an embedding row of
// `dim` floats, `num_slots` optimizer-slot rows of `dim` floats, an access count and
// the step of the last access. Free of TensorFlow, so that benchmarks/ can compile it
// into a plain C++ program and time it beside other hash maps in one harness; the
// TensorFlow ops are in hybrid_hash_ops.cc.
//
// Layout. Keys are split by hash into P partitions (P a power of two). Each partition
// is an open-addressing table (linear probing, at most 3/4 full) of 16-byte buckets
// {key, row pointer}, and an arena of rows: chunks that are allocated as the partition
// grows and never move, so a rehash only rewrites the buckets, and a row's address is
// stable while its key is in the table (an erased key's row is reused by a later
// insert). A row is a 24-byte header (count, last step, update stamp) followed by the
// value and then the slots, contiguous.
//
// Determinism. A batch is processed partition by partition, each partition's keys in
// batch order, so that one thread owning whole partitions needs no lock and the
// results (rows, counts, row placement) are the same for any number of threads and
// any scheduling. One thread processing the whole batch in batch order gives exactly
// the same result, since partitions never touch each other. New keys get their initial
// value from a counter-based hash of (seed, key, element), not from a stream of random
// numbers: a key's initial row does not depend on which keys came before it.
//
// Concurrency between batches (several ops on one table at once) is the caller's
// business: the table carries a reader/writer mutex that callers hold around each
// batch (exclusive for anything that writes, counts included; shared for reads).
#ifndef PICASSO_TF_CUSTOM_OPS_HASH_TABLE_H_
#define PICASSO_TF_CUSTOM_OPS_HASH_TABLE_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <shared_mutex>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace picasso {
namespace hash_table {

// SplitMix64's output function: a bijection of 64-bit words whose output bits each
// depend on every input bit. Used both to place keys and to draw initial values.
inline uint64_t Mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}
constexpr uint64_t kGolden = 0x9e3779b97f4a7c15ULL;  // 2^64 / golden ratio, odd

inline uint64_t KeyHash(int64_t key) { return Mix64(static_cast<uint64_t>(key) + kGolden); }

// The initial value of a new key's row: a distribution drawn per element from
// Mix64(base(seed, key) + counter), i.e. a counter-based generator keyed by the key.
enum class InitKind { kZeros, kConstant, kUniform, kNormal, kTruncatedNormal };

struct Initializer {
  InitKind kind = InitKind::kZeros;
  float a = 0.f;  // constant: the value; uniform: minval; normal/truncated: mean
  float b = 0.f;  // uniform: maxval; normal/truncated: stddev
  uint64_t seed = 0;

  bool operator==(const Initializer& o) const {
    return kind == o.kind && a == o.a && b == o.b && seed == o.seed;
  }

  void Fill(int64_t key, float* row, int64_t dim) const {
    const uint64_t base = Mix64(static_cast<uint64_t>(key) ^ Mix64(seed ^ 0x6a09e667f3bcc909ULL));
    switch (kind) {
      case InitKind::kZeros:
        std::fill(row, row + dim, 0.f);
        return;
      case InitKind::kConstant:
        std::fill(row, row + dim, a);
        return;
      case InitKind::kUniform: {
        const float width = b - a;
        for (int64_t j = 0; j < dim; ++j) {
          row[j] = a + width * Unit24(Mix64(base + (j + 1) * kGolden));
        }
        return;
      }
      case InitKind::kNormal:
        for (int64_t j = 0; j < dim; j += 2) {  // Box-Muller: two values per draw
          float z0, z1;
          Gaussians(Mix64(base + (j / 2 + 1) * kGolden), &z0, &z1);
          row[j] = a + b * z0;
          if (j + 1 < dim) row[j + 1] = a + b * z1;
        }
        return;
      case InitKind::kTruncatedNormal:
        // As TensorFlow's truncated normal: values beyond two standard deviations
        // are drawn again (about 1 in 22); each element has its own counters.
        for (int64_t j = 0; j < dim; ++j) {
          float z = 0.f, unused;
          for (uint64_t attempt = 0; attempt < 64; ++attempt) {
            Gaussians(Mix64(base + ((static_cast<uint64_t>(j) << 6) + attempt + 1) * kGolden), &z,
                      &unused);
            if (std::fabs(z) <= 2.f) break;
            z = 0.f;  // (never reached in practice: 64 rejections in a row)
          }
          row[j] = a + b * z;
        }
        return;
    }
  }

 private:
  // [0, 1) from the top 24 bits: exactly representable floats.
  static float Unit24(uint64_t bits) { return static_cast<float>(bits >> 40) * 0x1p-24f; }

  static void Gaussians(uint64_t bits, float* z0, float* z1) {
    const double u1 = (static_cast<double>(bits >> 32) + 1.0) * 0x1p-32;  // (0, 1]
    const double u2 = static_cast<double>(bits & 0xffffffffULL) * 0x1p-32;  // [0, 1)
    const double r = std::sqrt(-2.0 * std::log(u1));
    const double t = 6.283185307179586476925 * u2;
    *z0 = static_cast<float>(r * std::cos(t));
    *z1 = static_cast<float>(r * std::sin(t));
  }
};

struct Config {
  int64_t dim = 0;
  int64_t num_slots = 0;
  Initializer init;
  float slot_init = 0.f;      // every slot element of a new key
  int64_t num_partitions = 16;  // a power of two
  int64_t initial_capacity = 1024;  // keys, over all partitions, before the first growth

  bool operator==(const Config& o) const {
    return dim == o.dim && num_slots == o.num_slots && init == o.init &&
           slot_init == o.slot_init && num_partitions == o.num_partitions;
  }
};

struct RowHeader {
  int64_t count;      // find_or_insert accesses
  int64_t last_step;  // the step of the last find_or_insert
  uint64_t stamp;     // the last update that touched the row (finds repeated keys)
};

// What went wrong in a batch, for the caller to turn into its own error type.
struct Error {
  enum Code { kOk, kNotFound, kDuplicate, kInvalid } code = kOk;
  int64_t position = -1;  // in the batch
  int64_t key = 0;
  explicit operator bool() const { return code != kOk; }
};

// Runs fn(i) for i in [0, n), possibly on several threads; fn(i) calls for different i
// touch disjoint data. A null ParallelFor runs them in order on the calling thread.
using ParallelFor = std::function<void(int64_t n, const std::function<void(int64_t)>& fn)>;

// The optimizers' per-row math (see Table::ApplySgd); kD = d, or 0 for a run-time d.
template <int64_t kD>
inline void SgdRow(float* __restrict var, const float* __restrict g, float neg_lr, int64_t d) {
  const int64_t n = kD ? kD : d;
  for (int64_t j = 0; j < n; ++j) var[j] += neg_lr * g[j];
}

template <int64_t kD>
inline void AdagradRow(float* __restrict var, float* __restrict acc, const float* __restrict g,
                       float neg_lr, float epsilon, int64_t d) {
  const int64_t n = kD ? kD : d;
  for (int64_t j = 0; j < n; ++j) {
    acc[j] += g[j] * g[j];
    var[j] += neg_lr * g[j] / std::sqrt(acc[j] + epsilon);
  }
}

// Adam's scalars for a step (Keras' adam.py): alpha = lr * sqrt(1 - beta2^t) / (1 - beta1^t).
struct AdamScalars {
  float alpha, one_minus_beta1, one_minus_beta2, epsilon;
};

// kTouched: a row with a gradient; the others only decay (Keras' exact form reaches them).
// The same arithmetic in the same order as the fused kernels' (sparse_updates.h AdamUpdate).
template <int64_t kD, bool kTouched>
inline void AdamRow(float* __restrict var, float* __restrict m, float* __restrict v,
                    const float* __restrict g, const AdamScalars& s, int64_t d) {
  const int64_t n = kD ? kD : d;
  const float alpha = s.alpha, c1 = s.one_minus_beta1, c2 = s.one_minus_beta2, eps = s.epsilon;
  for (int64_t j = 0; j < n; ++j) {
    m[j] -= m[j] * c1;
    v[j] -= v[j] * c2;
    if constexpr (kTouched) {
      m[j] += g[j] * c1;
      v[j] += g[j] * g[j] * c2;
    }
    var[j] -= m[j] * alpha / (std::sqrt(v[j]) + eps);
  }
}

class Table {
 public:
  explicit Table(const Config& config) : config_(config) {
    log2_partitions_ = 0;
    while ((int64_t{1} << log2_partitions_) < config_.num_partitions) ++log2_partitions_;
    row_floats_ = config_.dim * (1 + config_.num_slots);
    row_bytes_ = (sizeof(RowHeader) + row_floats_ * sizeof(float) + 7) / 8 * 8;
    partitions_ = MakePartitions();
  }

  const Config& config() const { return config_; }
  std::shared_mutex& mutex() const { return mu_; }

  int64_t size() const {
    int64_t n = 0;
    for (const auto& p : partitions_) n += p.size;
    return n;
  }

  // Bytes held: buckets and row arenas.
  int64_t MemoryBytes() const {
    int64_t n = 0;
    for (const auto& p : partitions_) n += p.MemoryBytes(row_bytes_);
    return n;
  }

  static float* Values(char* row) { return reinterpret_cast<float*>(row + sizeof(RowHeader)); }
  float* Slot(char* row, int64_t s) const { return Values(row) + config_.dim * (1 + s); }
  static RowHeader* Header(char* row) { return reinterpret_cast<RowHeader*>(row); }

  // rows[i] = the value of keys[i], inserted (initialised) when missing; every
  // occurrence counts one access and sets the last step. rows: [n, dim].
  void FindOrInsert(const int64_t* keys, int64_t n, int64_t step, float* rows,
                    const ParallelFor* pf) {
    const int64_t dim = config_.dim;
    ByPartition(keys, n, pf, [&](Partition& part, int64_t i, int64_t key, uint64_t h) {
      char* row = part.FindOrInsert(key, h, *this);
      RowHeader* header = Header(row);
      header->count += 1;
      header->last_step = step;
      std::memcpy(rows + i * dim, Values(row), dim * sizeof(float));
    });
  }

  // As FindOrInsert, but rows[i] is keys[i]'s row itself (header, value, slots; its
  // address is stable until the next Import or Erase), for kernels that read or update rows in
  // place.
  void FindOrInsertRows(const int64_t* keys, int64_t n, int64_t step, char** rows,
                        const ParallelFor* pf) {
    ByPartition(keys, n, pf, [&](Partition& part, int64_t i, int64_t key, uint64_t h) {
      char* row = part.FindOrInsert(key, h, *this);
      RowHeader* header = Header(row);
      header->count += 1;
      header->last_step = step;
      rows[i] = row;
    });
  }

  // rows[i] = the value of keys[i], or zeros (found[i] = false) when missing. Reads
  // only: counts and steps stay.
  void Lookup(const int64_t* keys, int64_t n, float* rows, bool* found,
              const ParallelFor* pf) const {
    const int64_t dim = config_.dim;
    const_cast<Table*>(this)->ByPartition(
        keys, n, pf, [&](Partition& part, int64_t i, int64_t key, uint64_t h) {
          char* row = part.Find(key, h);
          found[i] = row != nullptr;
          if (row) {
            std::memcpy(rows + i * dim, Values(row), dim * sizeof(float));
          } else {
            std::fill(rows + i * dim, rows + (i + 1) * dim, 0.f);
          }
        });
  }

  // counts[i] = the access count of keys[i], 0 when missing (an admission filter reads
  // how often a key not yet given a row was seen). Reads only.
  void Counts(const int64_t* keys, int64_t n, int64_t* counts, const ParallelFor* pf) const {
    const_cast<Table*>(this)->ByPartition(
        keys, n, pf, [&](Partition& part, int64_t i, int64_t key, uint64_t h) {
          char* row = part.Find(key, h);
          counts[i] = row ? Header(row)->count : 0;
        });
  }

  // The rows of keys (each present and at most once), for an update that writes
  // them; on an error nothing has been written (stamps aside, which only this
  // function reads) and the error names the first offending position.
  Error RowsForUpdate(const int64_t* keys, int64_t n, std::vector<char*>* rows,
                      const ParallelFor* pf) {
    rows->assign(n, nullptr);
    const uint64_t stamp = ++stamp_;
    std::vector<Error> errors(partitions_.size());
    ByPartition(keys, n, pf, [&](Partition& part, int64_t i, int64_t key, uint64_t h) {
      Error& e = errors[&part - partitions_.data()];
      char* row = part.Find(key, h);
      if (row == nullptr) {
        if (!e) e = Error{Error::kNotFound, i, key};
        return;
      }
      RowHeader* header = Header(row);
      if (header->stamp == stamp) {
        if (!e) e = Error{Error::kDuplicate, i, key};
        return;
      }
      header->stamp = stamp;
      (*rows)[i] = row;
    });
    Error first;
    for (const Error& e : errors) {
      if (e && (!first || e.position < first.position)) first = e;
    }
    return first;
  }

  // Updates of the rows from RowsForUpdate with one gradient row per key (grads:
  // [n, dim]), as Keras' optimizers do for a row-sparse gradient:
  //   SGD:      var -= lr * g
  //   Adagrad:  acc += g * g;  var += -lr * g / sqrt(acc + epsilon)   (slot 0 = acc)
  void ApplySgd(const std::vector<char*>& rows, const float* grads, float lr,
                const ParallelFor* pf) {
    ForRows(rows, pf, [&](auto kd, char* row, int64_t i) {
      SgdRow<decltype(kd)::value>(Values(row), grads + i * config_.dim, -lr, config_.dim);
    });
  }

  void ApplyAdagrad(const std::vector<char*>& rows, const float* grads, float lr,
                    float epsilon, const ParallelFor* pf) {
    ForRows(rows, pf, [&](auto kd, char* row, int64_t i) {
      AdagradRow<decltype(kd)::value>(Values(row), Slot(row, 0), grads + i * config_.dim, -lr,
                                      epsilon, config_.dim);
    });
  }

  //   Adam:     (slots 0, 1 = m, v) as AdamRow; with `every_row` (Keras' exact form)
  //             every other row of the table decays too. Must follow the RowsForUpdate
  //             that found `rows`, under the same lock: its stamp marks them.
  void ApplyAdam(const std::vector<char*>& rows, const float* grads, const AdamScalars& scalars,
                 bool every_row, const ParallelFor* pf) {
    const int64_t dim = config_.dim;
    ForRows(rows, pf, [&](auto kd, char* row, int64_t i) {
      AdamRow<decltype(kd)::value, true>(Values(row), Slot(row, 0), Slot(row, 1), grads + i * dim,
                                         scalars, dim);
    });
    if (!every_row) return;
    std::vector<char*> others;
    for (const auto& p : partitions_) {
      for (const Bucket& b : p.buckets) {
        if (b.row != nullptr && Header(b.row)->stamp != stamp_) others.push_back(b.row);
      }
    }
    ForRows(others, pf, [&](auto kd, char* row, int64_t) {
      AdamRow<decltype(kd)::value, false>(Values(row), Slot(row, 0), Slot(row, 1), nullptr, scalars,
                                          dim);
    });
  }

  // Erases the keys (missing ones are skipped); their rows go to their partition's
  // free list, which its next inserts take first.
  void Erase(const int64_t* keys, int64_t n, const ParallelFor* pf) {
    ByPartition(keys, n, pf,
                [&](Partition& part, int64_t, int64_t key, uint64_t h) { part.Erase(key, h); });
  }

  // Evicts every key last looked up before `stale_before`, then all but the `keep` keys
  // ranked first: looked up most, then most recently, then the smaller key (a total
  // order, so the keys kept do not depend on the table's layout). Returns how many went.
  int64_t Evict(int64_t keep, int64_t stale_before, const ParallelFor* pf) {
    struct Ranked {
      int64_t count, last_step, key;
    };
    std::vector<Ranked> live, victims;
    for (const auto& p : partitions_) {
      for (const Bucket& b : p.buckets) {
        if (b.row == nullptr) continue;
        const RowHeader* header = Header(b.row);
        (header->last_step < stale_before ? victims : live)
            .push_back({header->count, header->last_step, b.key});
      }
    }
    if (static_cast<int64_t>(live.size()) > keep) {
      auto first = [](const Ranked& a, const Ranked& b) {
        if (a.count != b.count) return a.count > b.count;
        if (a.last_step != b.last_step) return a.last_step > b.last_step;
        return a.key < b.key;
      };
      std::nth_element(live.begin(), live.begin() + keep, live.end(), first);
      victims.insert(victims.end(), live.begin() + keep, live.end());
    }
    std::vector<int64_t> keys(victims.size());
    for (size_t i = 0; i < victims.size(); ++i) keys[i] = victims[i].key;
    std::sort(keys.begin(), keys.end());  // the buckets end the same whatever the scan order
    Erase(keys.data(), keys.size(), pf);
    return keys.size();
  }

  // The min(k, size) keys looked up most (ties: the smaller key), in that order, as
  // (count, key): Algorithm 1's choice of the hot set, without copying any row.
  std::vector<std::pair<int64_t, int64_t>> Hottest(int64_t k) const {
    std::vector<std::pair<int64_t, int64_t>> all;
    all.reserve(size());
    for (const auto& p : partitions_) {
      for (const Bucket& b : p.buckets) {
        if (b.row) all.emplace_back(Header(b.row)->count, b.key);
      }
    }
    auto first = [](const auto& x, const auto& y) {
      return x.first != y.first ? x.first > y.first : x.second < y.second;
    };
    k = std::min<int64_t>(k, all.size());
    std::nth_element(all.begin(), all.begin() + k, all.end(), first);
    all.resize(k);
    std::sort(all.begin(), all.end(), first);
    return all;
  }

  // Copies the value and slots of rows (from RowsForUpdate) into values [n, dim] and
  // slots [num_slots, n, dim].
  void ReadRows(const std::vector<char*>& rows, float* values, float* slots,
                const ParallelFor* pf) const {
    const int64_t n = rows.size(), dim = config_.dim;
    const_cast<Table*>(this)->ForRows(rows, pf, [&](auto, char* row, int64_t i) {
      std::memcpy(values + i * dim, Values(row), dim * sizeof(float));
      for (int64_t s = 0; s < config_.num_slots; ++s) {
        std::memcpy(slots + (s * n + i) * dim, Slot(row, s), dim * sizeof(float));
      }
    });
  }

  // The inverse of ReadRows, adding add_counts[i] to row i's access count (the lookups
  // a cache in front of the table counted while it held the row).
  void WriteRows(const std::vector<char*>& rows, const float* values, const float* slots,
                 const int64_t* add_counts, const ParallelFor* pf) {
    const int64_t n = rows.size(), dim = config_.dim;
    ForRows(rows, pf, [&](auto, char* row, int64_t i) {
      std::memcpy(Values(row), values + i * dim, dim * sizeof(float));
      for (int64_t s = 0; s < config_.num_slots; ++s) {
        std::memcpy(Slot(row, s), slots + (s * n + i) * dim, dim * sizeof(float));
      }
      Header(row)->count += add_counts[i];
    });
  }

  // All keys in increasing order with their rows.
  std::vector<std::pair<int64_t, char*>> SortedRows() const {
    std::vector<std::pair<int64_t, char*>> out;
    out.reserve(size());
    for (const auto& p : partitions_) {
      for (const Bucket& b : p.buckets) {
        if (b.row) out.emplace_back(b.key, b.row);
      }
    }
    std::sort(out.begin(), out.end(),
              [](const auto& x, const auto& y) { return x.first < y.first; });
    return out;
  }

  // Replaces the contents by n keys (unique) with their values [n, dim], slots
  // [num_slots, n, dim], counts and last steps. Builds the new contents beside the old
  // and swaps them in only when every key is in: on an error (a repeated key) the
  // table is unchanged.
  Error Import(const int64_t* keys, int64_t n, const float* values, const float* slots,
               const int64_t* counts, const int64_t* last_steps, const ParallelFor* pf) {
    std::vector<Partition> fresh = MakePartitions(n);
    std::swap(fresh, partitions_);  // ByPartition works on partitions_
    const int64_t dim = config_.dim;
    std::vector<Error> errors(partitions_.size());
    ByPartition(keys, n, pf, [&](Partition& part, int64_t i, int64_t key, uint64_t h) {
      Error& e = errors[&part - partitions_.data()];
      bool inserted = false;
      char* row = part.FindOrInsert(key, h, *this, &inserted, /*initialise=*/false);
      if (!inserted) {
        if (!e) e = Error{Error::kDuplicate, i, key};
        return;
      }
      RowHeader* header = Header(row);
      header->count = counts[i];
      header->last_step = last_steps[i];
      header->stamp = 0;
      std::memcpy(Values(row), values + i * dim, dim * sizeof(float));
      for (int64_t s = 0; s < config_.num_slots; ++s) {
        std::memcpy(Slot(row, s), slots + (s * n + i) * dim, dim * sizeof(float));
      }
    });
    Error first;
    for (const Error& e : errors) {
      if (e && (!first || e.position < first.position)) first = e;
    }
    if (first) std::swap(fresh, partitions_);  // back to the old contents
    return first;
  }

 private:
  struct Bucket {
    int64_t key;
    char* row;  // null: empty
  };

  // One partition: buckets and the arena of its rows. Only one thread at a time.
  struct Partition {
    std::vector<Bucket> buckets;
    uint64_t mask = 0;
    int64_t size = 0;
    std::vector<std::unique_ptr<char[]>> chunks;
    int64_t chunk_rows = 0, chunk_used = 0, arena_rows = 0;
    std::vector<char*> free_rows;  // rows of erased keys, reused first

    explicit Partition(int64_t capacity) {
      int64_t cap = 8;
      while (cap * 3 < capacity * 4) cap *= 2;  // capacity keys fit without growing
      buckets.assign(cap, Bucket{0, nullptr});
      mask = cap - 1;
    }

    int64_t MemoryBytes(int64_t row_bytes) const {
      return static_cast<int64_t>(buckets.size() * sizeof(Bucket)) + arena_rows * row_bytes;
    }

    char* Find(int64_t key, uint64_t h) const {
      for (uint64_t b = h & mask;; b = (b + 1) & mask) {
        const Bucket& bucket = buckets[b];
        if (bucket.row == nullptr) return nullptr;
        if (bucket.key == key) return bucket.row;
      }
    }

    char* FindOrInsert(int64_t key, uint64_t h, const Table& table, bool* inserted = nullptr,
                       bool initialise = true) {
      uint64_t b = h & mask;
      for (;; b = (b + 1) & mask) {
        const Bucket& bucket = buckets[b];
        if (bucket.row == nullptr) break;
        if (bucket.key == key) return bucket.row;
      }
      if ((size + 1) * 4 > static_cast<int64_t>(buckets.size()) * 3) {
        Grow();
        for (b = h & mask; buckets[b].row != nullptr; b = (b + 1) & mask) {
        }
      }
      char* row = NewRow(table.row_bytes_);
      if (initialise) table.Initialise(key, row);
      buckets[b] = Bucket{key, row};
      ++size;
      if (inserted) *inserted = true;
      return row;
    }

    // Frees the key's bucket by backward-shift deletion: the keys after it in its
    // probe run move back where their own probe passes, so lookups need no tombstones.
    void Erase(int64_t key, uint64_t h) {
      uint64_t hole = h & mask;
      for (;; hole = (hole + 1) & mask) {
        if (buckets[hole].row == nullptr) return;
        if (buckets[hole].key == key) break;
      }
      free_rows.push_back(buckets[hole].row);
      --size;
      for (uint64_t j = (hole + 1) & mask; buckets[j].row != nullptr; j = (j + 1) & mask) {
        const uint64_t home = KeyHash(buckets[j].key) & mask;
        // The key at j may fill the hole unless its home lies cyclically in (hole, j].
        const bool home_after_hole =
            hole <= j ? (hole < home && home <= j) : (hole < home || home <= j);
        if (!home_after_hole) {
          buckets[hole] = buckets[j];
          hole = j;
        }
      }
      buckets[hole] = Bucket{0, nullptr};
    }

    // Twice the buckets; every key moves to its bucket in the new array, the rows stay.
    void Grow() {
      std::vector<Bucket> old(buckets.size() * 2, Bucket{0, nullptr});
      old.swap(buckets);
      mask = buckets.size() - 1;
      for (const Bucket& o : old) {
        if (o.row == nullptr) continue;
        uint64_t b = KeyHash(o.key) & mask;
        while (buckets[b].row != nullptr) b = (b + 1) & mask;
        buckets[b] = o;
      }
    }

    // Each chunk holds half the rows before it, 16 to 1024: a small table stays small
    // (at most a third of its rows unused) and a large one leaves at most 1024 rows
    // unused per partition.
    char* NewRow(int64_t row_bytes) {
      if (!free_rows.empty()) {
        char* row = free_rows.back();
        free_rows.pop_back();
        return row;
      }
      if (chunk_used == chunk_rows) {
        chunk_rows = std::clamp<int64_t>(arena_rows / 2, 16, 1024);
        chunks.emplace_back(new char[chunk_rows * row_bytes]);
        arena_rows += chunk_rows;
        chunk_used = 0;
      }
      return chunks.back().get() + (chunk_used++) * row_bytes;
    }
  };

  std::vector<Partition> MakePartitions(int64_t keys = -1) const {
    const int64_t p = int64_t{1} << log2_partitions_;
    const int64_t capacity = keys < 0 ? config_.initial_capacity : keys;
    std::vector<Partition> out;
    out.reserve(p);
    for (int64_t i = 0; i < p; ++i) out.emplace_back((capacity + p - 1) / p);
    return out;
  }

  void Initialise(int64_t key, char* row) const {
    RowHeader* header = Header(row);
    header->count = 0;
    header->last_step = 0;
    header->stamp = 0;
    config_.init.Fill(key, Values(row), config_.dim);
    std::fill(Values(row) + config_.dim, Values(row) + row_floats_, config_.slot_init);
  }

  int64_t PartitionOf(uint64_t h) const {
    return log2_partitions_ == 0 ? 0 : static_cast<int64_t>(h >> (64 - log2_partitions_));
  }

  // Calls fn(partition, i, keys[i], hash) for every i, each partition's positions in
  // increasing order, partitions in parallel when pf is given and the batch is large
  // enough to pay for it. Buckets (and, for keys already present, rows) are
  // prefetched a few keys ahead.
  template <typename Fn>
  void ByPartition(const int64_t* keys, int64_t n, const ParallelFor* pf, const Fn& fn) {
    const int64_t num_partitions = partitions_.size();
    if (pf == nullptr || num_partitions == 1 || n < 4096) {
      Pipeline(n, [&](int64_t k) { return k; }, keys, fn);
      return;
    }
    // Counting sort of positions by partition (stable: batch order within each).
    std::vector<int64_t> start(num_partitions + 1, 0);
    std::vector<uint32_t> part_of(n);
    for (int64_t i = 0; i < n; ++i) {
      part_of[i] = static_cast<uint32_t>(PartitionOf(KeyHash(keys[i])));
      ++start[part_of[i] + 1];
    }
    for (int64_t p = 0; p < num_partitions; ++p) start[p + 1] += start[p];
    std::vector<int64_t> positions(n);
    {
      std::vector<int64_t> next(start.begin(), start.end() - 1);
      for (int64_t i = 0; i < n; ++i) positions[next[part_of[i]]++] = i;
    }
    (*pf)(num_partitions, [&](int64_t p) {
      const int64_t* pos = positions.data() + start[p];
      Pipeline(start[p + 1] - start[p], [pos](int64_t k) { return pos[k]; }, keys, fn);
    });
  }

  template <typename PositionAt, typename Fn>
  void Pipeline(int64_t count, const PositionAt& position_at, const int64_t* keys, const Fn& fn) {
    constexpr int64_t kBucketAhead = 16, kRowAhead = 8;
    auto bucket_of = [&](int64_t k) -> const Bucket* {
      const uint64_t h = KeyHash(keys[position_at(k)]);
      const Partition& part = partitions_[PartitionOf(h)];
      return &part.buckets[h & part.mask];
    };
    for (int64_t k = 0; k < std::min(count, kBucketAhead); ++k) __builtin_prefetch(bucket_of(k));
    for (int64_t k = 0; k < count; ++k) {
      if (k + kBucketAhead < count) __builtin_prefetch(bucket_of(k + kBucketAhead));
      if (k + kRowAhead < count) {
        const int64_t i = position_at(k + kRowAhead);
        const Bucket* b = bucket_of(k + kRowAhead);
        if (b->row != nullptr && b->key == keys[i]) {
          for (int64_t off = 0; off < row_bytes_; off += 64) __builtin_prefetch(b->row + off);
        }
      }
      const int64_t i = position_at(k);
      const int64_t key = keys[i];
      const uint64_t h = KeyHash(key);
      fn(partitions_[PartitionOf(h)], i, key, h);
    }
  }

  // Calls fn(std::integral_constant<int64_t, kD>, rows[i], i) for every i, in blocks of
  // 2048 keys run in parallel when pf is given (each row is in rows at most once, so
  // blocks touch disjoint rows); kD is dim for the usual widths, else 0.
  template <typename Fn>
  void ForRows(const std::vector<char*>& rows, const ParallelFor* pf, const Fn& fn) {
    const int64_t n = rows.size();
    auto block = [&](auto kd, int64_t begin, int64_t end) {
      constexpr int64_t kAhead = 8;
      for (int64_t i = begin; i < end; ++i) {
        if (i + kAhead < end) {
          for (int64_t off = 0; off < row_bytes_; off += 64) __builtin_prefetch(rows[i + kAhead] + off);
        }
        fn(kd, rows[i], i);
      }
    };
    auto run = [&](auto kd) {
      constexpr int64_t kBlock = 2048;
      const int64_t blocks = (n + kBlock - 1) / kBlock;
      if (pf == nullptr || blocks <= 1) {
        block(kd, 0, n);
      } else {
        (*pf)(blocks, [&](int64_t b) { block(kd, b * kBlock, std::min(n, (b + 1) * kBlock)); });
      }
    };
    switch (config_.dim) {
      case 8: return run(std::integral_constant<int64_t, 8>());
      case 16: return run(std::integral_constant<int64_t, 16>());
      case 32: return run(std::integral_constant<int64_t, 32>());
      case 64: return run(std::integral_constant<int64_t, 64>());
      case 128: return run(std::integral_constant<int64_t, 128>());
      default: return run(std::integral_constant<int64_t, 0>());
    }
  }

  Config config_;
  int log2_partitions_ = 0;
  int64_t row_floats_ = 0;  // value and slots
  int64_t row_bytes_ = 0;   // header, value and slots, rounded up to 8 bytes
  std::vector<Partition> partitions_;
  uint64_t stamp_ = 0;
  mutable std::shared_mutex mu_;
};

}  // namespace hash_table
}  // namespace picasso

#endif  // PICASSO_TF_CUSTOM_OPS_HASH_TABLE_H_
