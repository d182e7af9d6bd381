// HybridHash's cold tier as TensorFlow ops: a hash table resource from int64 key to an
// embedding row, its optimizer slots, an access count and the last access step
// (hash_table.h), created by PicassoHashTableCreate and used by
//   PicassoHashTableFindOrInsert  keys, step -> rows       (inserts missing keys)
//   PicassoHashTableLookup        keys -> rows, found      (reads only; zeros if missing)
//   PicassoHashTableApplySgd      keys (unique), grads, lr
//   PicassoHashTableApplyAdagrad  keys (unique), grads, lr, epsilon (slot 0 = accumulator)
//   PicassoHashTableApplyAdam     keys (unique), grads, lr, beta powers, 1 - betas, epsilon
//                                 (slots 0, 1 = m, v); every row decays unless lazy
//   PicassoHashTableExport        -> keys (sorted), values, slots, counts, last_steps
//   PicassoHashTableImport        keys, values, slots, counts, last_steps (replaces all)
//   PicassoHashTableHottest       k -> keys, counts        (the k looked up most)
//   PicassoHashTableRead          keys (unique) -> values, slots
//   PicassoHashTableWrite         keys (unique), values, slots, add_counts
//   PicassoHashTableSize          -> number of keys
//
// Each op holds the table's lock for its whole batch (exclusive when it writes, counts
// included; shared for Lookup, Export and Size), so that ops running at the same time
// on one table are race-free; within an op, the threads of TF's intra-op pool each own
// whole partitions of the table (or, for updates, disjoint rows), so the result does
// not depend on the number of threads or their timing.
//
// Errors leave the table as it was: an update checks every key (present, not
// repeated) before it writes a row; an import builds the new contents beside the old.
#define EIGEN_USE_THREADS

#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <vector>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "hash_table.h"
#include "picasso_common.h"

namespace tensorflow {
namespace picasso {
namespace {

using ::picasso::hash_table::AdamScalars;
using ::picasso::hash_table::Config;
using ::picasso::hash_table::Error;
using ::picasso::hash_table::InitKind;
using ::picasso::hash_table::ParallelFor;
using ::picasso::hash_table::Table;
using shape_inference::InferenceContext;
using shape_inference::ShapeHandle;

// ---------------------------------------------------------------------------
// Op registrations.

REGISTER_OP("PicassoHashTableCreate")
    .Output("table: resource")
    .Attr("dim: int >= 1")
    .Attr("num_slots: int >= 0 = 0")
    .Attr("initializer: {'zeros', 'constant', 'uniform', 'normal', 'truncated_normal'} = 'zeros'")
    .Attr("init_a: float = 0")  // constant: value; uniform: minval; normal: mean
    .Attr("init_b: float = 0")  // uniform: maxval; normal: stddev
    .Attr("seed: int = 0")
    .Attr("slot_init: float = 0")
    .Attr("num_partitions: int >= 1 = 16")
    .Attr("initial_capacity: int >= 0 = 1024")
    .Attr("container: string = ''")
    .Attr("shared_name: string = ''")
    .SetIsStateful()
    .SetShapeFn(shape_inference::ScalarShape);

Status RowsShape(InferenceContext* c) {
  int64_t dim;
  TF_RETURN_IF_ERROR(c->GetAttr("dim", &dim));
  ShapeHandle rows;
  TF_RETURN_IF_ERROR(c->Concatenate(c->input(1), c->Vector(dim), &rows));
  c->set_output(0, rows);
  if (c->num_outputs() > 1) c->set_output(1, c->input(1));
  return OkStatus();
}

REGISTER_OP("PicassoHashTableFindOrInsert")
    .Input("table: resource")
    .Input("keys: int64")
    .Input("step: int64")
    .Output("rows: float")
    .Attr("dim: int >= 1")
    .SetIsStateful()
    .SetShapeFn(RowsShape);

REGISTER_OP("PicassoHashTableLookup")
    .Input("table: resource")
    .Input("keys: int64")
    .Output("rows: float")
    .Output("found: bool")
    .Attr("dim: int >= 1")
    .SetIsStateful()
    .SetShapeFn(RowsShape);

REGISTER_OP("PicassoHashTableCounts")
    .Input("table: resource")
    .Input("keys: int64")
    .Output("counts: int64")
    .SetIsStateful()
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      c->set_output(0, c->input(1));
      return OkStatus();
    });

REGISTER_OP("PicassoHashTableErase")
    .Input("table: resource")
    .Input("keys: int64")
    .SetIsStateful()
    .SetShapeFn(shape_inference::NoOutputs);

REGISTER_OP("PicassoHashTableEvict")
    .Input("table: resource")
    .Input("keep: int64")
    .Input("stale_before: int64")
    .Output("evicted: int64")
    .SetIsStateful()
    .SetShapeFn(shape_inference::ScalarShape);

REGISTER_OP("PicassoHashTableApplySgd")
    .Input("table: resource")
    .Input("keys: int64")
    .Input("grads: float")
    .Input("lr: float")
    .SetIsStateful()
    .SetShapeFn(shape_inference::NoOutputs);

REGISTER_OP("PicassoHashTableApplyAdagrad")
    .Input("table: resource")
    .Input("keys: int64")
    .Input("grads: float")
    .Input("lr: float")
    .Input("epsilon: float")
    .SetIsStateful()
    .SetShapeFn(shape_inference::NoOutputs);

REGISTER_OP("PicassoHashTableApplyAdam")
    .Input("table: resource")
    .Input("keys: int64")
    .Input("grads: float")
    .Input("lr: float")
    .Input("beta1_power: float")
    .Input("beta2_power: float")
    .Input("one_minus_beta1: float")
    .Input("one_minus_beta2: float")
    .Input("epsilon: float")
    .Attr("lazy: bool = false")
    .SetIsStateful()
    .SetShapeFn(shape_inference::NoOutputs);

REGISTER_OP("PicassoHashTableExport")
    .Input("table: resource")
    .Output("keys: int64")
    .Output("values: float")
    .Output("slots: float")
    .Output("counts: int64")
    .Output("last_steps: int64")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      auto n = c->UnknownDim();
      c->set_output(0, c->Vector(n));
      c->set_output(1, c->Matrix(n, c->UnknownDim()));
      c->set_output(2, c->UnknownShapeOfRank(3));
      c->set_output(3, c->Vector(n));
      c->set_output(4, c->Vector(n));
      return OkStatus();
    });

REGISTER_OP("PicassoHashTableImport")
    .Input("table: resource")
    .Input("keys: int64")
    .Input("values: float")
    .Input("slots: float")
    .Input("counts: int64")
    .Input("last_steps: int64")
    .SetIsStateful()
    .SetShapeFn(shape_inference::NoOutputs);

// A hot tier's refresh moves only its own rows through these three (HybridHash's
// refresh would otherwise export and import the whole table).
REGISTER_OP("PicassoHashTableHottest")
    .Input("table: resource")
    .Input("k: int64")
    .Output("keys: int64")
    .Output("counts: int64")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      auto n = c->UnknownDim();
      c->set_output(0, c->Vector(n));
      c->set_output(1, c->Vector(n));
      return OkStatus();
    });

REGISTER_OP("PicassoHashTableRead")
    .Input("table: resource")
    .Input("keys: int64")
    .Output("values: float")
    .Output("slots: float")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->Matrix(c->Dim(c->input(1), 0), c->UnknownDim()));
      c->set_output(1, c->UnknownShapeOfRank(3));
      return OkStatus();
    });

REGISTER_OP("PicassoHashTableWrite")
    .Input("table: resource")
    .Input("keys: int64")
    .Input("values: float")
    .Input("slots: float")
    .Input("add_counts: int64")
    .SetIsStateful()
    .SetShapeFn(shape_inference::NoOutputs);

REGISTER_OP("PicassoHashTableSize")
    .Input("table: resource")
    .Output("size: int64")
    .SetIsStateful()
    .SetShapeFn(shape_inference::ScalarShape);

// ---------------------------------------------------------------------------
// The resource.

class HashTableResource : public ResourceBase {
 public:
  explicit HashTableResource(const Config& config) : table_(config) {}

  Table& table() { return table_; }

  std::string DebugString() const override {
    const Config& c = table_.config();
    return strings::StrCat("PicassoHashTable(dim=", c.dim, ", num_slots=", c.num_slots,
                           ", num_partitions=", c.num_partitions, ")");
  }

  int64_t MemoryUsed() const override {
    std::shared_lock<std::shared_mutex> lock(table_.mutex());
    return table_.MemoryBytes();
  }

 private:
  Table table_;
};

std::string Describe(const Config& c) {
  return strings::StrCat("dim=", c.dim, ", num_slots=", c.num_slots, ", initializer kind ",
                         static_cast<int>(c.init.kind), " (", c.init.a, ", ", c.init.b,
                         "), seed=", c.init.seed, ", slot_init=", c.slot_init,
                         ", num_partitions=", c.num_partitions);
}

class CreateOp : public OpKernel {
 public:
  explicit CreateOp(OpKernelConstruction* c) : OpKernel(c) {
    std::string init;
    int64_t seed;
    OP_REQUIRES_OK(c, c->GetAttr("dim", &config_.dim));
    OP_REQUIRES_OK(c, c->GetAttr("num_slots", &config_.num_slots));
    OP_REQUIRES_OK(c, c->GetAttr("initializer", &init));
    OP_REQUIRES_OK(c, c->GetAttr("init_a", &config_.init.a));
    OP_REQUIRES_OK(c, c->GetAttr("init_b", &config_.init.b));
    OP_REQUIRES_OK(c, c->GetAttr("seed", &seed));
    OP_REQUIRES_OK(c, c->GetAttr("slot_init", &config_.slot_init));
    OP_REQUIRES_OK(c, c->GetAttr("num_partitions", &config_.num_partitions));
    OP_REQUIRES_OK(c, c->GetAttr("initial_capacity", &config_.initial_capacity));
    config_.init.seed = static_cast<uint64_t>(seed);
    config_.init.kind = init == "zeros"      ? InitKind::kZeros
                        : init == "constant" ? InitKind::kConstant
                        : init == "uniform"  ? InitKind::kUniform
                        : init == "normal"   ? InitKind::kNormal
                                             : InitKind::kTruncatedNormal;
    const int64_t p = config_.num_partitions;
    OP_REQUIRES(c, (p & (p - 1)) == 0 && p <= 4096,
                errors::InvalidArgument("PicassoHashTableCreate: num_partitions must be a power "
                                        "of two up to 4096, got ", p));
  }

  void Compute(OpKernelContext* ctx) override {
    ContainerInfo cinfo;
    OP_REQUIRES_OK(ctx, cinfo.Init(ctx->resource_manager(), def(), /*use_node_name_as_default=*/true));
    HashTableResource* resource = nullptr;
    OP_REQUIRES_OK(ctx, ctx->resource_manager()->LookupOrCreate<HashTableResource>(
                            cinfo.container(), cinfo.name(), &resource,
                            [this](HashTableResource** out) {
                              *out = new HashTableResource(config_);
                              return OkStatus();
                            }));
    core::ScopedUnref unref(resource);
    OP_REQUIRES(ctx, resource->table().config() == config_,
                errors::AlreadyExists("PicassoHashTableCreate: a hash table named '", cinfo.name(),
                                      "' already exists with ", Describe(resource->table().config()),
                                      ", not ", Describe(config_),
                                      "; give the new table another shared_name"));
    OP_REQUIRES_OK(ctx, MakeResourceHandleToOutput(ctx, 0, cinfo.container(), cinfo.name(),
                                                   TypeIndex::Make<HashTableResource>()));
  }

 private:
  Config config_;
};

// ---------------------------------------------------------------------------
// Helpers of the table ops.

// The op's intra-op thread pool as the table's ParallelFor.
ParallelFor PoolOf(OpKernelContext* ctx) {
  return [ctx](int64_t n, const std::function<void(int64_t)>& fn) {
    ::picasso::RunWorkItems(ctx, n, /*parallel=*/true, fn);
  };
}

class TableOp : public OpKernel {
 public:
  using OpKernel::OpKernel;

 protected:
  Status GetTable(OpKernelContext* ctx, core::RefCountPtr<HashTableResource>* out) {
    return LookupResource(ctx, HandleFromInput(ctx, 0), out);
  }

  // What an error of the table says, for this op.
  Status ToStatus(const Error& e, const std::string& what,
                  const char* unique_hint = "sum the rows of repeated keys first (tf.unique, "
                                            "then tf.math.unsorted_segment_sum)",
                  const char* missing_hint = "look a batch's keys up with find_or_insert before "
                                             "applying their gradients") const {
    switch (e.code) {
      case Error::kNotFound:
        return errors::NotFound(name(), ": key ", e.key, " (", what, "[", e.position,
                                "]) is not in the hash table; ", missing_hint,
                                ". Nothing was updated.");
      case Error::kDuplicate:
        return errors::InvalidArgument(
            name(), ": key ", e.key, " appears more than once in ", what, " (again at position ",
            e.position, "); the keys must be unique: ", unique_hint, ". Nothing was changed.");
      default:
        return OkStatus();
    }
  }
};

// An op that reads rows of its attr `dim` floats: output 0 holds a row per key.
class RowsOutputOp : public TableOp {
 public:
  explicit RowsOutputOp(OpKernelConstruction* c) : TableOp(c) {
    OP_REQUIRES_OK(c, c->GetAttr("dim", &dim_));
  }

 protected:
  // The table, refused unless its rows are `dim` wide; and output 0, [keys..., dim].
  Status TableAndRows(OpKernelContext* ctx, const Tensor& keys,
                      core::RefCountPtr<HashTableResource>* resource, Tensor** rows) {
    TF_RETURN_IF_ERROR(GetTable(ctx, resource));
    const int64_t table_dim = (*resource)->table().config().dim;
    if (table_dim != dim_) {
      return errors::InvalidArgument(name(), ": the op asks for rows of ", dim_,
                                     " floats but the hash table's dim is ", table_dim);
    }
    TensorShape shape = keys.shape();
    shape.AddDim(dim_);
    return ctx->allocate_output(0, shape, rows);
  }

 private:
  int64_t dim_;
};

class FindOrInsertOp : public RowsOutputOp {
 public:
  using RowsOutputOp::RowsOutputOp;

  void Compute(OpKernelContext* ctx) override {
    const Tensor& keys = ctx->input(1);
    const Tensor& step = ctx->input(2);
    OP_REQUIRES(ctx, TensorShapeUtils::IsScalar(step.shape()),
                errors::InvalidArgument(name(), ": step must be a scalar, got shape ",
                                        step.shape().DebugString()));
    core::RefCountPtr<HashTableResource> resource;
    Tensor* rows = nullptr;
    OP_REQUIRES_OK(ctx, TableAndRows(ctx, keys, &resource, &rows));
    Table& table = resource->table();
    const ParallelFor pool = PoolOf(ctx);
    std::unique_lock<std::shared_mutex> lock(table.mutex());
    table.FindOrInsert(keys.flat<int64_t>().data(), keys.NumElements(), step.scalar<int64_t>()(),
                       rows->flat<float>().data(), &pool);
  }
};

class LookupOp : public RowsOutputOp {
 public:
  using RowsOutputOp::RowsOutputOp;

  void Compute(OpKernelContext* ctx) override {
    const Tensor& keys = ctx->input(1);
    core::RefCountPtr<HashTableResource> resource;
    Tensor *rows = nullptr, *found = nullptr;
    OP_REQUIRES_OK(ctx, TableAndRows(ctx, keys, &resource, &rows));
    Table& table = resource->table();
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, keys.shape(), &found));
    const ParallelFor pool = PoolOf(ctx);
    std::shared_lock<std::shared_mutex> lock(table.mutex());
    table.Lookup(keys.flat<int64_t>().data(), keys.NumElements(), rows->flat<float>().data(),
                 found->flat<bool>().data(), &pool);
  }
};

class CountsOp : public TableOp {
 public:
  using TableOp::TableOp;

  void Compute(OpKernelContext* ctx) override {
    core::RefCountPtr<HashTableResource> resource;
    OP_REQUIRES_OK(ctx, GetTable(ctx, &resource));
    const Tensor& keys = ctx->input(1);
    Tensor* counts = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, keys.shape(), &counts));
    const ParallelFor pool = PoolOf(ctx);
    std::shared_lock<std::shared_mutex> lock(resource->table().mutex());
    resource->table().Counts(keys.flat<int64_t>().data(), keys.NumElements(),
                             counts->flat<int64_t>().data(), &pool);
  }
};

class EraseOp : public TableOp {
 public:
  using TableOp::TableOp;

  void Compute(OpKernelContext* ctx) override {
    core::RefCountPtr<HashTableResource> resource;
    OP_REQUIRES_OK(ctx, GetTable(ctx, &resource));
    const Tensor& keys = ctx->input(1);
    const ParallelFor pool = PoolOf(ctx);
    std::unique_lock<std::shared_mutex> lock(resource->table().mutex());
    resource->table().Erase(keys.flat<int64_t>().data(), keys.NumElements(), &pool);
  }
};

class EvictOp : public TableOp {
 public:
  using TableOp::TableOp;

  void Compute(OpKernelContext* ctx) override {
    core::RefCountPtr<HashTableResource> resource;
    OP_REQUIRES_OK(ctx, GetTable(ctx, &resource));
    for (int i : {1, 2}) {
      OP_REQUIRES(ctx, TensorShapeUtils::IsScalar(ctx->input(i).shape()),
                  errors::InvalidArgument(name(), ": keep and stale_before must be scalars"));
    }
    const int64_t keep = ctx->input(1).scalar<int64_t>()();
    OP_REQUIRES(ctx, keep >= 0, errors::InvalidArgument(name(), ": keep must be >= 0, got ", keep));
    Tensor* evicted = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &evicted));
    const ParallelFor pool = PoolOf(ctx);
    std::unique_lock<std::shared_mutex> lock(resource->table().mutex());
    evicted->scalar<int64_t>()() =
        resource->table().Evict(keep, ctx->input(2).scalar<int64_t>()(), &pool);
  }
};

// Shared by the updates: checks the inputs, finds every key's row (present, unique),
// then lets apply(rows, grads, pool) write them.
class ApplyOp : public TableOp {
 public:
  using TableOp::TableOp;

  void Compute(OpKernelContext* ctx) override {
    core::RefCountPtr<HashTableResource> resource;
    OP_REQUIRES_OK(ctx, GetTable(ctx, &resource));
    Table& table = resource->table();
    const int64_t dim = table.config().dim;
    OP_REQUIRES(ctx, table.config().num_slots >= slots_needed(),
                errors::InvalidArgument(name(), " needs ", slots_needed(), " slot(s) (",
                                        slot_names(), ") but the hash table has ",
                                        table.config().num_slots,
                                        "; create it with num_slots=", slots_needed()));
    const Tensor& keys = ctx->input(1);
    const Tensor& grads = ctx->input(2);
    OP_REQUIRES(ctx, TensorShapeUtils::IsVector(keys.shape()),
                errors::InvalidArgument(name(), ": keys must be a vector, got shape ",
                                        keys.shape().DebugString()));
    const int64_t n = keys.NumElements();
    OP_REQUIRES(ctx, grads.shape() == TensorShape({n, dim}),
                errors::InvalidArgument(name(), ": grads must be [", n, ", ", dim,
                                        "] (one row of the table's dim per key), got ",
                                        grads.shape().DebugString()));
    for (int i = 3; i < ctx->num_inputs(); ++i) {
      OP_REQUIRES(ctx, TensorShapeUtils::IsScalar(ctx->input(i).shape()),
                  errors::InvalidArgument(name(), ": input ", i, " (a hyper-parameter) must be "
                                          "a scalar, got shape ",
                                          ctx->input(i).shape().DebugString()));
    }
    const ParallelFor pool = PoolOf(ctx);
    std::unique_lock<std::shared_mutex> lock(table.mutex());
    std::vector<char*> rows;
    const Error e = table.RowsForUpdate(keys.flat<int64_t>().data(), n, &rows, &pool);
    OP_REQUIRES_OK(ctx, ToStatus(e, "keys"));
    Apply(ctx, table, rows, grads.flat<float>().data(), pool);
  }

 protected:
  virtual int64_t slots_needed() const = 0;
  virtual const char* slot_names() const = 0;
  virtual void Apply(OpKernelContext* ctx, Table& table, const std::vector<char*>& rows,
                     const float* grads, const ParallelFor& pool) = 0;
};

class ApplySgdOp : public ApplyOp {
 public:
  using ApplyOp::ApplyOp;

 protected:
  int64_t slots_needed() const override { return 0; }
  const char* slot_names() const override { return ""; }
  void Apply(OpKernelContext* ctx, Table& table, const std::vector<char*>& rows,
             const float* grads, const ParallelFor& pool) override {
    table.ApplySgd(rows, grads, ctx->input(3).scalar<float>()(), &pool);
  }
};

class ApplyAdagradOp : public ApplyOp {
 public:
  using ApplyOp::ApplyOp;

 protected:
  int64_t slots_needed() const override { return 1; }
  const char* slot_names() const override { return "the accumulator"; }
  void Apply(OpKernelContext* ctx, Table& table, const std::vector<char*>& rows,
             const float* grads, const ParallelFor& pool) override {
    table.ApplyAdagrad(rows, grads, ctx->input(3).scalar<float>()(),
                       ctx->input(4).scalar<float>()(), &pool);
  }
};

class ApplyAdamOp : public ApplyOp {
 public:
  explicit ApplyAdamOp(OpKernelConstruction* ctx) : ApplyOp(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("lazy", &lazy_));
  }

 protected:
  int64_t slots_needed() const override { return 2; }
  const char* slot_names() const override { return "m, v"; }
  void Apply(OpKernelContext* ctx, Table& table, const std::vector<char*>& rows,
             const float* grads, const ParallelFor& pool) override {
    auto in = [&](int i) { return ctx->input(i).scalar<float>()(); };
    // alpha as the fused kernels compute it (sparse_updates.h AdamUpdate), so the same rounding.
    const AdamScalars scalars{in(3) * std::sqrt(1.f - in(5)) / (1.f - in(4)), in(6), in(7), in(8)};
    table.ApplyAdam(rows, grads, scalars, !lazy_, &pool);
  }

 private:
  bool lazy_ = false;
};

class ExportOp : public TableOp {
 public:
  using TableOp::TableOp;

  void Compute(OpKernelContext* ctx) override {
    core::RefCountPtr<HashTableResource> resource;
    OP_REQUIRES_OK(ctx, GetTable(ctx, &resource));
    Table& table = resource->table();
    const int64_t dim = table.config().dim, num_slots = table.config().num_slots;
    std::shared_lock<std::shared_mutex> lock(table.mutex());
    const auto sorted = table.SortedRows();
    const int64_t n = sorted.size();
    Tensor *keys, *values, *slots, *counts, *last_steps;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({n}), &keys));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({n, dim}), &values));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(2, TensorShape({num_slots, n, dim}), &slots));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(3, TensorShape({n}), &counts));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(4, TensorShape({n}), &last_steps));
    auto k = keys->flat<int64_t>();
    float* v = values->flat<float>().data();
    float* s = slots->flat<float>().data();
    auto c = counts->flat<int64_t>();
    auto l = last_steps->flat<int64_t>();
    constexpr int64_t kBlock = 4096;
    ::picasso::RunWorkItems(ctx, (n + kBlock - 1) / kBlock, n > kBlock, [&](int64_t b) {
      for (int64_t i = b * kBlock; i < std::min(n, (b + 1) * kBlock); ++i) {
        char* row = sorted[i].second;
        k(i) = sorted[i].first;
        c(i) = Table::Header(row)->count;
        l(i) = Table::Header(row)->last_step;
        std::memcpy(v + i * dim, Table::Values(row), dim * sizeof(float));
        for (int64_t j = 0; j < num_slots; ++j) {
          std::memcpy(s + (j * n + i) * dim, table.Slot(row, j), dim * sizeof(float));
        }
      }
    });
  }
};

class ImportOp : public TableOp {
 public:
  using TableOp::TableOp;

  void Compute(OpKernelContext* ctx) override {
    core::RefCountPtr<HashTableResource> resource;
    OP_REQUIRES_OK(ctx, GetTable(ctx, &resource));
    Table& table = resource->table();
    const int64_t dim = table.config().dim, num_slots = table.config().num_slots;
    const Tensor& keys = ctx->input(1);
    OP_REQUIRES(ctx, TensorShapeUtils::IsVector(keys.shape()),
                errors::InvalidArgument(name(), ": keys must be a vector, got shape ",
                                        keys.shape().DebugString()));
    const int64_t n = keys.NumElements();
    const char* names[] = {"keys", "values", "slots", "counts", "last_steps"};
    const TensorShape expected[] = {TensorShape({n}), TensorShape({n, dim}),
                                    TensorShape({num_slots, n, dim}), TensorShape({n}),
                                    TensorShape({n})};
    for (int i = 2; i < 6; ++i) {
      const TensorShape& got = ctx->input(i).shape();
      if (got == expected[i - 1]) continue;
      std::string hint;
      if (i == 2 && got.dims() == 2 && got.dim_size(0) == n) {
        hint = strings::StrCat(": the rows have ", got.dim_size(1), " floats but this table's dim is ",
                               dim, "; import into a table created with dim=", got.dim_size(1));
      } else if (i == 3 && got.dims() == 3 && got.dim_size(1) == n) {
        hint = strings::StrCat(": ", got.dim_size(0), " slot(s) of ", got.dim_size(2),
                               " floats, but this table has num_slots=", num_slots, " and dim=",
                               dim, "; import into a table created like the exported one");
      }
      OP_REQUIRES(ctx, false,
                  errors::InvalidArgument(name(), ": ", names[i - 1], " must be ",
                                          expected[i - 1].DebugString(), " for ", n,
                                          " keys, got ", got.DebugString(), hint,
                                          ". Nothing was changed."));
    }
    const ParallelFor pool = PoolOf(ctx);
    std::unique_lock<std::shared_mutex> lock(table.mutex());
    const Error e = table.Import(keys.flat<int64_t>().data(), n, ctx->input(2).flat<float>().data(),
                                 ctx->input(3).flat<float>().data(),
                                 ctx->input(4).flat<int64_t>().data(),
                                 ctx->input(5).flat<int64_t>().data(), &pool);
    OP_REQUIRES_OK(ctx, ToStatus(e, "keys", "an export never repeats a key, so these keys do "
                                            "not come from one"));
  }
};

class HottestOp : public TableOp {
 public:
  using TableOp::TableOp;

  void Compute(OpKernelContext* ctx) override {
    core::RefCountPtr<HashTableResource> resource;
    OP_REQUIRES_OK(ctx, GetTable(ctx, &resource));
    const Tensor& k = ctx->input(1);
    OP_REQUIRES(ctx, TensorShapeUtils::IsScalar(k.shape()) && k.scalar<int64_t>()() >= 0,
                errors::InvalidArgument(name(), ": k must be a scalar >= 0, got ", k.DebugString()));
    std::shared_lock<std::shared_mutex> lock(resource->table().mutex());
    const auto hottest = resource->table().Hottest(k.scalar<int64_t>()());
    const int64_t n = hottest.size();
    Tensor *keys, *counts;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({n}), &keys));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({n}), &counts));
    for (int64_t i = 0; i < n; ++i) {
      counts->flat<int64_t>()(i) = hottest[i].first;
      keys->flat<int64_t>()(i) = hottest[i].second;
    }
  }
};

// Shared by Read and Write: checks the keys, finds every key's row (present, unique)
// under the table's exclusive lock, then lets Move(ctx, table, rows, pool) copy them.
class RowsOp : public TableOp {
 public:
  using TableOp::TableOp;

  void Compute(OpKernelContext* ctx) override {
    core::RefCountPtr<HashTableResource> resource;
    OP_REQUIRES_OK(ctx, GetTable(ctx, &resource));
    Table& table = resource->table();
    const Tensor& keys = ctx->input(1);
    OP_REQUIRES(ctx, TensorShapeUtils::IsVector(keys.shape()),
                errors::InvalidArgument(name(), ": keys must be a vector, got shape ",
                                        keys.shape().DebugString()));
    const ParallelFor pool = PoolOf(ctx);
    std::unique_lock<std::shared_mutex> lock(table.mutex());
    OP_REQUIRES_OK(ctx, CheckInputs(ctx, table.config(), keys.NumElements()));
    std::vector<char*> rows;
    const Error e = table.RowsForUpdate(keys.flat<int64_t>().data(), keys.NumElements(), &rows, &pool);
    OP_REQUIRES_OK(ctx, ToStatus(e, "keys", "give each key once",
                                 "read or write only keys the table holds (find_or_insert "
                                 "inserts them)"));
    Move(ctx, table, rows, pool);
  }

 protected:
  virtual Status CheckInputs(OpKernelContext* ctx, const Config& config, int64_t n) const {
    return OkStatus();
  }
  virtual void Move(OpKernelContext* ctx, Table& table, const std::vector<char*>& rows,
                    const ParallelFor& pool) = 0;
};

class ReadOp : public RowsOp {
 public:
  using RowsOp::RowsOp;

 protected:
  void Move(OpKernelContext* ctx, Table& table, const std::vector<char*>& rows,
            const ParallelFor& pool) override {
    const int64_t n = rows.size(), dim = table.config().dim;
    Tensor *values, *slots;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({n, dim}), &values));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(
                            1, TensorShape({table.config().num_slots, n, dim}), &slots));
    table.ReadRows(rows, values->flat<float>().data(), slots->flat<float>().data(), &pool);
  }
};

class WriteOp : public RowsOp {
 public:
  using RowsOp::RowsOp;

 protected:
  Status CheckInputs(OpKernelContext* ctx, const Config& config, int64_t n) const override {
    const TensorShape expected[] = {TensorShape({n, config.dim}),
                                    TensorShape({config.num_slots, n, config.dim}),
                                    TensorShape({n})};
    const char* names[] = {"values", "slots", "add_counts"};
    for (int i = 0; i < 3; ++i) {
      if (ctx->input(i + 2).shape() != expected[i]) {
        return errors::InvalidArgument(name(), ": ", names[i], " must be ",
                                       expected[i].DebugString(), " for ", n, " keys, got ",
                                       ctx->input(i + 2).shape().DebugString(),
                                       ". Nothing was changed.");
      }
    }
    return OkStatus();
  }
  void Move(OpKernelContext* ctx, Table& table, const std::vector<char*>& rows,
            const ParallelFor& pool) override {
    table.WriteRows(rows, ctx->input(2).flat<float>().data(), ctx->input(3).flat<float>().data(),
                    ctx->input(4).flat<int64_t>().data(), &pool);
  }
};

class SizeOp : public TableOp {
 public:
  using TableOp::TableOp;

  void Compute(OpKernelContext* ctx) override {
    core::RefCountPtr<HashTableResource> resource;
    OP_REQUIRES_OK(ctx, GetTable(ctx, &resource));
    Tensor* size = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &size));
    std::shared_lock<std::shared_mutex> lock(resource->table().mutex());
    size->scalar<int64_t>()() = resource->table().size();
  }
};

REGISTER_KERNEL_BUILDER(Name("PicassoHashTableCreate").Device(DEVICE_CPU), CreateOp);
REGISTER_KERNEL_BUILDER(Name("PicassoHashTableFindOrInsert").Device(DEVICE_CPU), FindOrInsertOp);
REGISTER_KERNEL_BUILDER(Name("PicassoHashTableLookup").Device(DEVICE_CPU), LookupOp);
REGISTER_KERNEL_BUILDER(Name("PicassoHashTableCounts").Device(DEVICE_CPU), CountsOp);
REGISTER_KERNEL_BUILDER(Name("PicassoHashTableErase").Device(DEVICE_CPU), EraseOp);
REGISTER_KERNEL_BUILDER(Name("PicassoHashTableEvict").Device(DEVICE_CPU), EvictOp);
REGISTER_KERNEL_BUILDER(Name("PicassoHashTableApplySgd").Device(DEVICE_CPU), ApplySgdOp);
REGISTER_KERNEL_BUILDER(Name("PicassoHashTableApplyAdagrad").Device(DEVICE_CPU), ApplyAdagradOp);
REGISTER_KERNEL_BUILDER(Name("PicassoHashTableApplyAdam").Device(DEVICE_CPU), ApplyAdamOp);
REGISTER_KERNEL_BUILDER(Name("PicassoHashTableExport").Device(DEVICE_CPU), ExportOp);
REGISTER_KERNEL_BUILDER(Name("PicassoHashTableImport").Device(DEVICE_CPU), ImportOp);
REGISTER_KERNEL_BUILDER(Name("PicassoHashTableHottest").Device(DEVICE_CPU), HottestOp);
REGISTER_KERNEL_BUILDER(Name("PicassoHashTableRead").Device(DEVICE_CPU), ReadOp);
REGISTER_KERNEL_BUILDER(Name("PicassoHashTableWrite").Device(DEVICE_CPU), WriteOp);
REGISTER_KERNEL_BUILDER(Name("PicassoHashTableSize").Device(DEVICE_CPU), SizeOp);

}  // namespace
}  // namespace picasso
}  // namespace tensorflow
