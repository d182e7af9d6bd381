// An embedding step (wide_lr's, or a zoo cell's) as plain C++ loops, which
// benchmarks/memory_floor.py sets picasso_tf's fused kernels beside. No TensorFlow, no
// id checks, no deterministic order: the row reads and writes the step cannot avoid,
// and the arithmetic on them.
//
//   memory_floor IDS_FILE REPEATS
//
// IDS_FILE: int64 fields, batch, then per field its vocab, width and ids per example
// (1 for a one-hot field, L for a sequence pooled by sum), then each field's ids
// [batch][ids per example], -1 for a padded position (skipped). Two threads, as picasso_tf's intra-op pool on this machine (-DTHREADS=N
// for N); rows prefetched AHEAD ahead (-DAHEAD=N, 8 by default). Prints one line per
// pass: its name and the median milliseconds over REPEATS.
//
//   forward      logit[b] = sum over fields and ids of table_f[id] . w_f (one row read per id)
//   update       per field: the upstream scalar summed per unique id (the projection's
//                row gradient is that sum times w_f), then Adagrad on each unique row:
//                its table row and its accumulator row read and written, w_f's
//                gradient gains the row times the sum (Keras' layout: two arrays)
//   update, one row  the same with each table row and its accumulator row side by side
//                in one array (the layout Keras' slot variables do not have)
//   lines read   the forward's cache lines only: one float of each line of each id's row
//                read, no arithmetic (the memory system's floor for the forward)
//   lines updated  the update's cache lines only: one float of each line of each unique
//                row and of its accumulator row incremented (its floor for the update)
//   whole tables  Adagrad on every element of every table and its accumulator, with an L2
//                regulariser's gradient alone: the pass a table that its regulariser reads
//                whole needs every step, whatever rows its ids touched
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <thread>
#include <vector>

namespace {

#ifndef THREADS
#define THREADS 2
#endif
constexpr int kThreads = THREADS;
#ifndef AHEAD
#define AHEAD 8
#endif
constexpr int64_t kAhead = AHEAD;  // rows prefetched ahead

// Tables start on a cache line, as TensorFlow's allocations do.
template <typename T>
struct LineAligned {
  using value_type = T;
  LineAligned() = default;
  template <typename U>
  LineAligned(const LineAligned<U>&) {}
  T* allocate(size_t n) {
    return static_cast<T*>(std::aligned_alloc(64, (n * sizeof(T) + 63) / 64 * 64));
  }
  void deallocate(T* p, size_t) { std::free(p); }
  bool operator==(const LineAligned&) const { return true; }
};
using Rows = std::vector<float, LineAligned<float>>;

struct Field {
  int64_t vocab, d, per_example;
  std::vector<int64_t> ids;
  Rows table, acc, both;
  std::vector<float> w, dw, sums;
  std::vector<uint8_t> seen;
  std::vector<int64_t> unique;
};

void Prefetch(const float* p, int64_t n, int write) {
  for (int64_t b = 0; b < n * 4; b += 64) __builtin_prefetch(reinterpret_cast<const char*>(p) + b, write);
}

// Runs work(item) for items [0, n) on kThreads threads, each taking the next item.
void OnThreads(int64_t n, const std::function<void(int64_t)>& work) {
  std::atomic<int64_t> next{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&] {
      for (int64_t i; (i = next.fetch_add(1)) < n;) work(i);
    });
  }
  for (auto& t : threads) t.join();
}

// Each thread adds every field into its half of the batch: the dot product of each id's
// row with w_f or, kLinesOnly, one float of each cache line of the row (the memory
// traffic alone).
template <bool kLinesOnly>
void Forward(std::vector<Field>& fields, int64_t batch, std::vector<float>& logits) {
  OnThreads(kThreads, [&](int64_t t) {
    const int64_t b0 = batch * t / kThreads, b1 = batch * (t + 1) / kThreads;
    for (auto& f : fields) {
      const int64_t* ids = f.ids.data();
      const int64_t n = f.per_example, j1 = b1 * n;
      for (int64_t j = b0 * n; j < j1; ++j) {
        if (j + kAhead < j1 && ids[j + kAhead] >= 0) Prefetch(f.table.data() + ids[j + kAhead] * f.d, f.d, 0);
        if (ids[j] < 0) continue;
        const float* __restrict row = f.table.data() + ids[j] * f.d;
        const float* __restrict w = f.w.data();
        float sum = 0;
        if (kLinesOnly) {
          for (int64_t k = 0; k < f.d; k += 16) sum += row[k];
        } else {
          for (int64_t k = 0; k < f.d; ++k) sum += row[k] * w[k];
        }
        logits[j / n] += sum;
      }
    }
  });
}

// The unique ids of f and the upstream summed per id (in f.sums, indexed by id).
void SumUpstream(Field& f, const std::vector<float>& dy) {
  f.unique.clear();
  for (size_t j = 0; j < f.ids.size(); ++j) {
    const int64_t id = f.ids[j];
    if (id < 0) continue;
    if (!f.seen[id]) {
      f.seen[id] = 1;
      f.unique.push_back(id);
    }
    f.sums[id] += dy[j / f.per_example];
  }
}

void Update(std::vector<Field>& fields, const std::vector<float>& dy, bool one_row) {
  constexpr float kRate = 0.01f;
  OnThreads(static_cast<int64_t>(fields.size()), [&](int64_t i) {
    Field& f = fields[i];
    SumUpstream(f, dy);
    const int64_t d = f.d, n = static_cast<int64_t>(f.unique.size());
    for (int64_t j = 0; j < n; ++j) {
      if (j + kAhead < n) {
        const int64_t ahead = f.unique[j + kAhead];
        if (one_row) {
          Prefetch(f.both.data() + ahead * 2 * d, 2 * d, 1);
        } else {
          Prefetch(f.table.data() + ahead * d, d, 1);
          Prefetch(f.acc.data() + ahead * d, d, 1);
        }
      }
      const int64_t u = f.unique[j];
      float* __restrict row = one_row ? f.both.data() + u * 2 * d : f.table.data() + u * d;
      float* __restrict acc = one_row ? row + d : f.acc.data() + u * d;
      const float* __restrict w = f.w.data();
      float* __restrict dw = f.dw.data();
      const float s = f.sums[u];
      for (int64_t k = 0; k < d; ++k) {
        const float g = s * w[k];
        dw[k] += s * row[k];
        acc[k] += g * g;
        row[k] -= kRate * g / std::sqrt(acc[k]);
      }
      f.sums[u] = 0;
      f.seen[u] = 0;
    }
  });
}

// Increments one float of every cache line of every unique row and its accumulator row
// (the unique ids found beforehand): the update's memory traffic.
void UpdateLines(std::vector<Field>& fields) {
  OnThreads(static_cast<int64_t>(fields.size()), [&](int64_t i) {
    Field& f = fields[i];
    const int64_t d = f.d, n = static_cast<int64_t>(f.unique.size());
    for (int64_t j = 0; j < n; ++j) {
      if (j + kAhead < n) {
        Prefetch(f.table.data() + f.unique[j + kAhead] * d, d, 1);
        Prefetch(f.acc.data() + f.unique[j + kAhead] * d, d, 1);
      }
      float* row = f.table.data() + f.unique[j] * d;
      float* acc = f.acc.data() + f.unique[j] * d;
      for (int64_t k = 0; k < d; k += 16) {
        row[k] += 1e-9f;
        acc[k] += 1e-9f;
      }
    }
  });
}

// Every element of every table and its accumulator read and written (the regularised
// tables' pass), one table a work item.
void WholeTables(std::vector<Field>& fields) {
  constexpr float kRate = 0.01f, kScale = 2e-5f;  // 2 x DeepCTR's default l2_reg_embedding
  OnThreads(static_cast<int64_t>(fields.size()), [&](int64_t i) {
    Field& f = fields[i];
    float* __restrict row = f.table.data();
    float* __restrict acc = f.acc.data();
    const int64_t n = f.vocab * f.d;
    for (int64_t k = 0; k < n; ++k) {
      const float g = kScale * row[k];
      acc[k] += g * g;
      row[k] -= kRate * g / std::sqrt(acc[k]);
    }
  });
}

double Milliseconds(const std::function<void()>& pass) {
  const auto start = std::chrono::steady_clock::now();
  pass();
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s IDS_FILE REPEATS\n", argv[0]);
    return 2;
  }
  FILE* in = std::fopen(argv[1], "rb");
  if (!in) {
    std::perror(argv[1]);
    return 2;
  }
  int64_t header[2];
  if (std::fread(header, sizeof(int64_t), 2, in) != 2) return 2;
  const int64_t num_fields = header[0], batch = header[1];
  std::vector<Field> fields(num_fields);
  for (auto& f : fields) {
    int64_t shape[3];
    if (std::fread(shape, sizeof(int64_t), 3, in) != 3) return 2;
    f.vocab = shape[0];
    f.d = shape[1];
    f.per_example = shape[2];
  }
  for (auto& f : fields) {
    const size_t n = batch * f.per_example;
    f.ids.resize(n);
    if (std::fread(f.ids.data(), sizeof(int64_t), n, in) != n) return 2;
    f.table.assign(f.vocab * f.d, 0.01f);
    f.acc.assign(f.vocab * f.d, 0.1f);
    f.both.assign(f.vocab * f.d * 2, 0.1f);
    f.w.assign(f.d, 0.02f);
    f.dw.assign(f.d, 0.0f);
    f.sums.assign(f.vocab, 0.0f);
    f.seen.assign(f.vocab, 0);
  }
  std::fclose(in);
  std::vector<float> logits(batch), dy(batch);
  for (int64_t b = 0; b < batch; ++b) dy[b] = (b % 7 - 3) * 1e-4f;

  const int repeats = std::atoi(argv[2]);
  if (repeats < 1) {
    std::fprintf(stderr, "REPEATS must be at least 1, got %s\n", argv[2]);
    return 2;
  }
  const std::vector<std::pair<const char*, std::function<void()>>> passes = {
      {"forward", [&] { Forward<false>(fields, batch, logits); }},
      {"update", [&] { Update(fields, dy, false); }},
      {"update, one row", [&] { Update(fields, dy, true); }},
      {"lines read", [&] { Forward<true>(fields, batch, logits); }},
      {"lines updated", [&] { UpdateLines(fields); }},  // f.unique: the last update's
      {"whole tables", [&] { WholeTables(fields); }},
  };
  std::vector<std::vector<double>> times(passes.size());
  for (int r = 0; r < repeats + 2; ++r) {  // the first two warm up
    for (size_t p = 0; p < passes.size(); ++p) {
      const double ms = Milliseconds(passes[p].second);
      if (r >= 2) times[p].push_back(ms);
    }
  }
  for (size_t p = 0; p < passes.size(); ++p) {
    std::nth_element(times[p].begin(), times[p].begin() + times[p].size() / 2, times[p].end());
    std::printf("%s\t%.3f\n", passes[p].first, times[p][times[p].size() / 2]);
  }
  return 0;
}
