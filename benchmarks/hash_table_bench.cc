// One core, three hash maps, the same training-step work on the same ids: compiled and
// run by benchmarks/hash_table.py (which writes the ids and reads what this prints).
//
// Per batch of N ids, for every map:
//   unique       ids -> unique keys U (first-appearance order) and idx [N]; the same
//                small per-batch probing table for every map (what tf.unique does)
//   find-insert  the U keys' rows, new keys initialised (uniform, per key) with their
//                Adagrad accumulator at 0.1; count += 1, last step = batch
//   gather       out[i] = value of idx[i]'s row                        [N, dim]
//   adagrad      g_u = sum of grads[i] per unique key; Adagrad on the U rows
// The maps:
//   picasso      custom_ops/hash_table.h (one partition-set table, run on one thread)
//   absl         absl::flat_hash_map<int64, int64 row index> + rows in 1024-row chunks
//   std          std::unordered_map<int64, int64 row index> + rows in 1024-row chunks
// The arena maps get the same initializer and the same row math; only the map from key
// to row and the row storage differ. Batches are interleaved between the maps, so a
// noisy neighbour slows all of them alike (and each map's rows leave the cache
// between its batches, as they would beside a model's other work).
//
// usage: hash_table_bench IDS_FILE BATCH DIM WARMUP_BATCHES
// prints one line per map: "name dim ids_per_cpu_second distinct_keys bytes_per_key"
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <string>
#include <ctime>
#include <unordered_map>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "hash_table.h"

namespace {

using picasso::hash_table::AdagradRow;
using picasso::hash_table::Config;
using picasso::hash_table::InitKind;
using picasso::hash_table::Table;

constexpr float kLr = 0.05f, kEpsilon = 1e-7f, kAccInit = 0.1f;

// ids -> unique (first appearance order), idx; a linear-probing set cleared by epoch.
class Unique {
 public:
  explicit Unique(int64_t n) {
    int64_t cap = 16;
    while (cap < 2 * n) cap *= 2;
    keys_.resize(cap);
    slot_.resize(cap);
    epoch_.assign(cap, 0);
    mask_ = cap - 1;
  }

  int64_t Run(const int64_t* ids, int64_t n, std::vector<int64_t>* uniq, std::vector<int32_t>* idx) {
    ++now_;
    uniq->clear();
    idx->resize(n);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t key = ids[i];
      uint64_t b = picasso::hash_table::KeyHash(key) & mask_;
      while (epoch_[b] == now_ && keys_[b] != key) b = (b + 1) & mask_;
      if (epoch_[b] != now_) {
        epoch_[b] = now_;
        keys_[b] = key;
        slot_[b] = uniq->size();
        uniq->push_back(key);
      }
      (*idx)[i] = slot_[b];
    }
    return uniq->size();
  }

 private:
  std::vector<int64_t> keys_;
  std::vector<int32_t> slot_;
  std::vector<uint32_t> epoch_;
  uint64_t mask_;
  uint32_t now_ = 0;
};

Config MakeConfig(int64_t dim) {
  Config c;
  c.dim = dim;
  c.num_slots = 1;
  c.init.kind = InitKind::kUniform;
  c.init.a = -0.05f;
  c.init.b = 0.05f;
  c.init.seed = 1;
  c.slot_init = kAccInit;
  return c;
}

// Scratch of one batch, shared by the maps' steps.
struct Batch {
  std::vector<int64_t> uniq;
  std::vector<int32_t> idx;
  std::vector<float> out, grads, g_u;
};

// The gather and the segment sum + Adagrad, given each unique key's value pointer
// (value, then the accumulator right after it).
template <int64_t kD>
void GatherAndUpdate(Batch& b, const std::vector<float*>& values, int64_t dim) {
  const int64_t n = b.idx.size(), u = b.uniq.size();
  for (int64_t i = 0; i < n; ++i) {
    std::memcpy(&b.out[i * dim], values[b.idx[i]], (kD ? kD : dim) * sizeof(float));
  }
  std::fill(b.g_u.begin(), b.g_u.begin() + u * dim, 0.f);
  for (int64_t i = 0; i < n; ++i) {
    float* dst = &b.g_u[b.idx[i] * dim];
    const float* src = &b.grads[i * dim];
    for (int64_t j = 0; j < (kD ? kD : dim); ++j) dst[j] += src[j];
  }
  for (int64_t k = 0; k < u; ++k) {
    AdagradRow<kD>(values[k], values[k] + dim, &b.g_u[k * dim], -kLr, kEpsilon, dim);
  }
}

class PicassoMap {
 public:
  explicit PicassoMap(int64_t dim) : table_(MakeConfig(dim)), dim_(dim) {}
  template <int64_t kD>
  void Step(Batch& b, int64_t step) {
    rows_.resize(b.uniq.size());
    values_.resize(b.uniq.size());
    table_.FindOrInsertRows(b.uniq.data(), b.uniq.size(), step, rows_.data(), nullptr);
    for (size_t k = 0; k < rows_.size(); ++k) values_[k] = Table::Values(rows_[k]);
    GatherAndUpdate<kD>(b, values_, dim_);
  }
  int64_t size() const { return table_.size(); }
  int64_t bytes() const { return table_.MemoryBytes(); }

 private:
  Table table_;
  int64_t dim_;
  std::vector<char*> rows_;
  std::vector<float*> values_;
};

// key -> row index into chunks of [value, accumulator] rows, plus counts and steps.
template <typename MapT>
class ArenaMap {
 public:
  explicit ArenaMap(int64_t dim) : config_(MakeConfig(dim)), dim_(dim) {}
  template <int64_t kD>
  void Step(Batch& b, int64_t step) {
    const int64_t u = b.uniq.size();
    row_of_.resize(u);
    for (int64_t k = 0; k < u; ++k) {
      auto [it, inserted] = map_.try_emplace(b.uniq[k], static_cast<int64_t>(counts_.size()));
      if (inserted) {
        if ((counts_.size() & (kChunkRows - 1)) == 0) {
          chunks_.emplace_back(new float[kChunkRows * 2 * dim_]);
        }
        float* row = RowOf(counts_.size());
        config_.init.Fill(b.uniq[k], row, dim_);
        std::fill(row + dim_, row + 2 * dim_, kAccInit);
        counts_.push_back(0);
        steps_.push_back(0);
      }
      const int64_t r = it->second;
      counts_[r] += 1;
      steps_[r] = step;
      row_of_[k] = r;
    }
    values_.resize(u);
    for (int64_t k = 0; k < u; ++k) values_[k] = RowOf(row_of_[k]);
    GatherAndUpdate<kD>(b, values_, dim_);
  }
  int64_t size() const { return map_.size(); }
  int64_t bytes() const { return -1; }

 private:
  static constexpr int64_t kChunkRows = 1024;
  float* RowOf(int64_t r) { return chunks_[r / kChunkRows].get() + (r % kChunkRows) * 2 * dim_; }

  Config config_;
  int64_t dim_;
  MapT map_;
  std::vector<std::unique_ptr<float[]>> chunks_;  // rows never move, as in hash_table.h
  std::vector<int64_t> counts_, steps_, row_of_;
  std::vector<float*> values_;
};

// CPU seconds of this (single-threaded) process: on a shared machine, time spent
// waiting for the core is not the table's.
double CpuSeconds() {
  timespec ts;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

template <int64_t kD>
int Run(const std::vector<int64_t>& ids, int64_t batch, int64_t dim, int64_t warmup) {
  const int64_t batches = ids.size() / batch;
  Batch b;
  b.out.resize(batch * dim);
  b.g_u.resize(batch * dim);
  b.grads.resize(batch * dim);
  uint64_t s = 12345;
  for (float& g : b.grads) {
    s = picasso::hash_table::Mix64(s + picasso::hash_table::kGolden);
    g = (static_cast<float>(s >> 40) * 0x1p-24f - 0.5f) * 0.01f;
  }
  Unique unique(batch);
  PicassoMap picasso_map(dim);
  ArenaMap<absl::flat_hash_map<int64_t, int64_t>> absl_map(dim);
  ArenaMap<std::unordered_map<int64_t, int64_t>> std_map(dim);
  double seconds[3] = {0, 0, 0};
  for (int64_t t = 0; t < batches; ++t) {
    for (int m = 0; m < 3; ++m) {
      const double start = CpuSeconds();
      unique.Run(ids.data() + t * batch, batch, &b.uniq, &b.idx);
      if (m == 0) picasso_map.Step<kD>(b, t);
      if (m == 1) absl_map.Step<kD>(b, t);
      if (m == 2) std_map.Step<kD>(b, t);
      const double dt = CpuSeconds() - start;
      if (t >= warmup) seconds[m] += dt;
    }
  }
  const double timed_ids = static_cast<double>((batches - warmup) * batch);
  const int64_t sizes[3] = {picasso_map.size(), absl_map.size(), std_map.size()};
  const int64_t bytes[3] = {picasso_map.bytes(), absl_map.bytes(), std_map.bytes()};
  const char* names[3] = {"picasso", "absl", "std"};
  for (int m = 0; m < 3; ++m) {
    std::printf("%s %lld %.0f %lld %.1f\n", names[m], static_cast<long long>(dim),
                timed_ids / seconds[m], static_cast<long long>(sizes[m]),
                bytes[m] < 0 ? -1.0 : static_cast<double>(bytes[m]) / sizes[m]);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 5) {
    std::fprintf(stderr, "usage: %s IDS_FILE BATCH DIM WARMUP_BATCHES\n", argv[0]);
    return 2;
  }
  std::ifstream in(argv[1], std::ios::binary | std::ios::ate);
  std::vector<int64_t> ids(static_cast<size_t>(in.tellg()) / sizeof(int64_t));
  in.seekg(0);
  in.read(reinterpret_cast<char*>(ids.data()), ids.size() * sizeof(int64_t));
  const int64_t batch = std::atoll(argv[2]), dim = std::atoll(argv[3]), warmup = std::atoll(argv[4]);
  switch (dim) {
    case 16: return Run<16>(ids, batch, dim, warmup);
    case 32: return Run<32>(ids, batch, dim, warmup);
    case 64: return Run<64>(ids, batch, dim, warmup);
    default: return Run<0>(ids, batch, dim, warmup);
  }
}
