"""Config: every option of picasso_tf.optimize in one documented object.

Each rewrite pass can be switched off on its own, which is how the paper's ablation
(Table IV) is run: `picasso_tf.optimize(model, packing=False)`.
"""
import dataclasses
import os
from typing import Optional, Tuple, Union


@dataclasses.dataclass
class Config:
    """Options of the rewrite and of the training step.

    packing: group same-dimension embedding tables into packed tables (D-packing) and
      replace their per-feature op chains by fused kernels (K-packing). `d_packing` /
      `k_packing` switch the two halves separately (K-packing needs D-packing's groups).
    stitching: where the model concatenates (or stacks) lookup outputs, have K-packing
      write them straight into the concatenation's layout, so that neither the
      concatenation nor the split of its gradient copies them.
    projection: where such a concatenation only feeds a MatMul (a logistic regression,
      a wide part, an MLP's first layer), compute the product and its gradients from the
      tables' rows directly, so that the concatenation and its gradient are never
      built. With more than 8 output units both work per unique row of the batch rather
      than per sample (sums then run in another order than the MatMul's: equal up to
      rounding), which pays off where ids repeat within a batch, as CTR ids do (the
      benchmark's W&D, Zipf 1.2: a 1.6x faster step); where nearly every id of a batch
      is distinct it is slower than the MatMul (uniform ids: a 13% slower step). So
      with warm-up data, a wide projection is used only where at most
      `projection_max_distinct` of the warm-up batches' ids are distinct within their
      feature (the report's stitch entry says when it was skipped; the share depends on
      the batch size, so warm up with training-sized batches); without warm-up data it
      is always used. The default, 0.75, sits below the break-even measured on the
      benchmark's W&D (`benchmarks/projection_breakeven.txt`: 25% distinct 1.89x
      faster, 54% 1.28x, 79% 1.00x, 90% 0.92x).
    sequence_pooling: where the model only sums or averages a sequence feature's looked-up
      rows over the sequence (optionally weighted by a mask or any per-position weight),
      have the fused lookup pool them, so that the [B, L, D] rows and the reduction's
      gradient are never built (equal up to summation order).
    interactions: replace a DLRM-style dot interaction (the product of [B, F, d]
      features with themselves, transposed, gathered at constant positions) by one
      kernel computing only the gathered dot products, and its gradient without the
      [B, F, F] product (equal up to rounding). The report lists what it fused and
      which self-products it left alone, and why.
    dense_packing: K-packing of the dense ops a model repeats per field or per expert
      (CAN's co-action units, MMoE's experts, gates and towers, per-sequence attention):
      layer calls whose ops are the same, independent of each other, run as one
      vectorised computation whose matrix products are batched (equal up to rounding;
      picasso_tf.passes.dense_packing). The report lists what it packed and what it left
      alone, and why. Off with packing=False too (the paper's ablation: no K-packing).
    shard_heavy_groups: split packed groups whose parameter volume (the paper's Eq. 1,
      CalcVParam) is above average into several shards, at most max_shards each.
    warmup_batches: how many batches of `warmup_data` feed the ID statistics of Eq. 1;
      without data the statistics come from the input shapes (uniform ids).
    hybrid_hash, distribute, interleaving: the caching, hybrid-parallel and interleaving
      passes; their slots run in order and report what they did. hybrid_hash=True keeps
      the packed groups that only fused lookups read in a hash table keyed by row id
      (picasso_tf.embedding.hybrid_hash), trained as the tables would be; models
      compiled with SGD (no momentum), Adagrad or Adam, one micro-batch; under Horovod each
      rank holds a share of the rows.
    hot_storage_bytes: HybridHash's hot tier (Algorithm 1): bytes for the rows (with
      their optimizer slot) looked up most often, over all hash-backed groups, shared
      in proportion to their parameter volume (Eq. 1); 0: no hot tier.
    hot_warmup_steps, hot_refresh_every: the hot set is chosen from the lookup counts
      after the warm-up steps, and again every hot_refresh_every steps.
    hot_refresh: how the hot set is chosen. "counts" (the default): Algorithm 1, from the
      lookup counts, inside the training step. "lookahead" (Bagpipe's idea: the future
      is known): `fit` reads its tf.data.Dataset a few batches ahead of Keras (which
      sees the same batches in the same order) and, at the first step of each pass over
      the dataset and every hot_refresh_every steps of it, makes the hot set the ids
      looked up in most of the next hot_lookahead_batches batches of the pass, then
      those of highest count, then the smaller id (HybridHashTables.refresh_ahead);
      hot_warmup_steps does not apply. Only `fit` refreshes it (train_on_batch and
      custom loops call refresh_ahead themselves); one process only (not under Horovod);
      fit refuses input that is not a tf.data.Dataset.
    hot_lookahead_batches: how many batches ahead a lookahead refresh reads; None (the
      default): hot_refresh_every, the batches until the next refresh.
    hot_tier_device: where the hot tiers' rows and optimizer slots live: None (the
      default) the first GPU TensorFlow sees, else the host; or a device name such as
      "/CPU:0" or "/GPU:1". A GPU tier is trained by TensorFlow's own ops; the hot
      tiers must fit in the device's free memory.
    dynamic_vocabulary: where the model hashes raw ids into a fixed number of bins right
      before an embedding (Keras Hashing, tf.strings.to_hash_bucket*, a modulo by a
      constant), key the table by the raw id instead: no collisions, a row only for the
      ids seen (picasso_tf.passes.dynamic_vocabulary). True: every such feature; a list
      of feature names: those. This trains a different model from the one written (the
      report says so); the trained tables are hash tables, exported by
      model.picasso.vocabulary(), not the model's variables. Off by default.
    vocabulary_capacity: keys a dynamic-vocabulary table may hold (None: no bound).
      Beyond it the keys ranked last by `eviction` go (picasso_tf.embedding.
      dynamic_vocabulary); a batch with more distinct ids of a table than this is an error.
    admit_after: a dynamic-vocabulary key gets a row once looked up this many times (1:
      at once); until then it reads zeros and its gradient is dropped.
    admission_filter: how admit_after counts the keys without a row: "exact" (a hash
      table of counts) or "bloom" (a counting Bloom filter of bloom_filter_counters
      int32 counters: fixed memory, may admit a key early, never late).
    eviction: which keys leave a full dynamic-vocabulary table: "lfu" (looked up least)
      or "ttl" (not looked up in the last steps_to_live steps first; those also go every
      steps_to_live steps whatever the size).
    replicate_tables_below: under Horovod with several ranks, a packed group with fewer
      bytes than this stays whole on every rank (its gradient joins the dense Allreduce)
      instead of being sharded. The exchange costs each step a fixed amount of CPU (three
      dependent AllToAllv plus deduplication) that exceeds allreducing tables of several
      MiB on CPUs (benchmarks/hybrid_parallel.txt), and sharding does not yet lower a
      rank's memory (each rank keeps the original tables), so only large groups are
      sharded by default. 0 shards every group that can be.
    wire_dtype: under Horovod with several ranks, the type the sharded groups' rows and
      row gradients travel in over the exchange's AllToAllv (picasso_tf.distributed.wire):
      "float32" (the default: as they are, the step exact up to summation order) or
      "float16" (Persia's idea: half their bytes; each rank computes in float32, the
      rows rounded to float16 on the wire and the row gradients scaled by a power of two
      before they are, so the updates differ from float32's by that rounding). The ids
      stay int64, and the Allreduce of dense and replicated tables' gradients stays
      float32. No effect in one process (there is no exchange).
    micro_batches: D-interleaving: each training step runs the batch as this many
      micro-batches (sizes differing by at most one), sums their gradients and applies
      them once: the same step as the whole batch's, up to summation order, with at most
      two micro-batches' activations alive (picasso_tf.runtime.micro_batches). Refused for
      models that normalise or reduce over the batch, and for losses that are not batch
      means. "auto": the fewest micro-batches whose activations fit
      `micro_batch_memory_budget` (the paper's Eq. 2), from the activation bytes per
      sample of the forward pass on the first batch of `warmup_data` (needed), for the
      traced batch size or else the warm-up batch's; models that couple samples, or
      whose loss is no batch mean, keep the batch whole. The report's k_interleave
      entry says which K and why (picasso_tf.runtime.micro_batch_planner). With an
      explicit K (from the embedding) the fused lookups' backward runs once per step on
      their output gradients gathered from the micro-batches, which is faster but holds
      the whole batch of those gradients; "auto", chosen for memory, keeps each
      micro-batch's own lookup backward and runs the micro-batches one at a time (one
      micro-batch's activations alive, none overlapping the previous one's backward).
      Under Horovod an explicit K exchanges each micro-batch's rows apart (from the
      embedding) and runs the micro-batches one at a time (a refused step then leaves
      no collective half-run); "auto" is refused: every rank must run as many.
    interleave_from: where micro-batches start (paper Fig. 8): "embedding" (the
      default, Fig. 8b) splits the batch at the inputs, each micro-batch running the
      whole model; "mlp" (Fig. 8a) runs the fused lookups once on the whole batch and
      only the rest of the model (the dense part) per micro-batch, taking its rows of
      the lookups' outputs, whose gradients are gathered for one backward of the
      lookups (picasso_tf.runtime.micro_batches.EmbeddingCut). Lookups left unfused
      run per micro-batch either way.
    micro_batch_memory_budget: the bytes one micro-batch's activations may take under
      micro_batches="auto"; None (the default): a quarter of the memory available when
      the step is traced (the rest for the whole batch's tensors, the data pipeline and
      the allocators' slack).
    interleave_groups: K-interleaving: the fused lookups go into this many groups of
      about equal parameter volume (Eq. 3), each group's lookups waiting for the
      previous group's (picasso_tf.passes.interleaving). 1 (the default): no groups,
      as they have not paid on a CPU.
    interleave_excluded: the fused lookups kept out of the interleaving groups' chains
      (the paper's excluded embeddings: no control dependencies either way). "auto" (the
      default): those whose outputs are not concatenated with other feature embeddings
      (a wide part summed on its own, weights of a co-action unit), whose downstream
      ops need not wait for other groups; or a list of feature names, excluding the
      fused lookups that read any of them; () chains every fused lookup. The report's
      k_interleave entry lists them with the reason.
    fused_optimizer: update packed tables with picasso_tf's fused row-sparse kernels
      (when the user's optimizer is supported) instead of the Keras optimizer.
    fused_dense_optimizer: update the other (dense) variables with one multi-tensor op
      per dtype that does what the Keras optimizer's apply_gradients does (SGD with
      momentum and Nesterov, Adagrad, FTRL, Adam, AdamW, RMSprop; weight decay,
      constraints, schedules), on its own slot variables, in Keras' float operation
      order, instead of Keras' few ops per variable (picasso_tf.runtime.dense_update).
      Where Keras does something it does not (gradient clipping, use_ema, mixed
      precision, a subclass overriding the update) it stands down to Keras and the
      report's optimizer line says why. Off with packing=False too (the ablation).
    apply_in_gradient: where the optimizer leaves rows without a gradient alone (Adagrad,
      SGD without momentum, the lazy forms) and a table's gradient comes from one stitched
      projection or stitched lookup, apply the update inside the kernel that computes the
      gradient, while the rows are in cache, instead of writing the gradient out for a
      second kernel (same result).
    lazy_optimizer: for Adam, AdamW and RMSprop (whose Keras forms decay every row of a
      table every step), update only the rows a batch touched. Off by default: a
      different algorithm from what the user asked for, so it is never implied.
    check_ids: validate ids against the table sizes inside the fused kernels (errors
      name the feature and the value).
    check_numerics: stop at a NaN or Inf in a float input feature with an error naming
      the feature (tf.errors.InvalidArgumentError from a CheckNumerics op on each float
      feature, in every step). Off by default: Keras trains on such values (its loss
      becomes NaN), and so does the rewritten model, with the same result; on, a
      corrupt batch is found where it enters instead of as a NaN loss.
    """
    packing: bool = True
    d_packing: bool = True
    k_packing: bool = True
    stitching: bool = True
    projection: bool = True
    projection_max_distinct: float = 0.75
    sequence_pooling: bool = True
    interactions: bool = True
    dense_packing: bool = True
    shard_heavy_groups: bool = True
    max_shards: int = 4
    warmup_batches: int = 8
    hybrid_hash: bool = False
    hot_storage_bytes: int = 64 << 20
    hot_warmup_steps: int = 100
    hot_refresh_every: int = 100
    hot_refresh: str = "counts"
    hot_lookahead_batches: Optional[int] = None
    hot_tier_device: Optional[str] = None
    dynamic_vocabulary: Union[bool, Tuple[str, ...]] = False
    vocabulary_capacity: Optional[int] = None
    admit_after: int = 1
    admission_filter: str = "exact"
    bloom_filter_counters: int = 1 << 20
    eviction: str = "lfu"
    steps_to_live: Optional[int] = None
    distribute: bool = True
    replicate_tables_below: int = 16 << 20
    wire_dtype: str = "float32"
    interleaving: bool = True
    micro_batches: Union[int, str] = 1
    micro_batch_memory_budget: Optional[int] = None
    interleave_from: str = "embedding"
    interleave_groups: int = 1
    interleave_excluded: Union[str, Tuple[str, ...]] = "auto"
    fused_optimizer: bool = True
    fused_dense_optimizer: bool = True
    apply_in_gradient: bool = True
    lazy_optimizer: bool = False
    check_ids: bool = True
    check_numerics: bool = False

    def __post_init__(self):
        if self.micro_batches != "auto" and not (isinstance(self.micro_batches, int) and self.micro_batches >= 1):
            raise ValueError(f"micro_batches must be an int >= 1 or 'auto', got {self.micro_batches!r}")
        if self.interleave_from not in ("embedding", "mlp"):
            raise ValueError(f"interleave_from must be 'embedding' or 'mlp', got {self.interleave_from!r}")
        if self.micro_batch_memory_budget is not None and self.micro_batch_memory_budget <= 0:
            raise ValueError(f"micro_batch_memory_budget must be a number of bytes > 0, got "
                             f"{self.micro_batch_memory_budget}")
        if self.interleave_groups < 1:
            raise ValueError(f"interleave_groups must be >= 1, got {self.interleave_groups}")
        if self.interleave_excluded != "auto" and (isinstance(self.interleave_excluded, str) or not all(
                isinstance(f, str) for f in self.interleave_excluded)):
            raise ValueError(f"interleave_excluded must be 'auto' or a list of feature names, got "
                             f"{self.interleave_excluded!r}")
        if self.replicate_tables_below < 0:
            raise ValueError(f"replicate_tables_below is a size in bytes, >= 0; got {self.replicate_tables_below}")
        if self.wire_dtype not in ("float32", "float16"):
            raise ValueError(f"wire_dtype is the type the exchanged rows and row gradients travel in: 'float32' "
                             f"(as they are) or 'float16' (half the bytes); got {self.wire_dtype!r}")
        if self.hot_storage_bytes < 0:
            raise ValueError(f"hot_storage_bytes is a size in bytes, >= 0; got {self.hot_storage_bytes}")
        if self.hot_warmup_steps < 0 or self.hot_refresh_every < 1:
            raise ValueError(f"hot_warmup_steps must be >= 0 and hot_refresh_every >= 1; got "
                             f"{self.hot_warmup_steps} and {self.hot_refresh_every}")
        if self.hot_refresh not in ("counts", "lookahead"):
            raise ValueError(f"hot_refresh must be 'counts' (Algorithm 1) or 'lookahead' (from the next batches fit "
                             f"reads), got {self.hot_refresh!r}")
        if self.hot_lookahead_batches is not None and not (
                isinstance(self.hot_lookahead_batches, int) and self.hot_lookahead_batches >= 1):
            raise ValueError(f"hot_lookahead_batches must be a number of batches >= 1 or None (hot_refresh_every), "
                             f"got {self.hot_lookahead_batches!r}")
        self._check_hot_tier_device()
        self._check_vocabulary_options()
        if self.max_shards < 1:
            raise ValueError(f"max_shards must be >= 1, got {self.max_shards}")
        if not 0.0 <= self.projection_max_distinct <= 1.0:
            raise ValueError(f"projection_max_distinct is a share of ids, in [0, 1]; got {self.projection_max_distinct}")
        if self.warmup_batches < 0:
            raise ValueError(f"warmup_batches must be >= 0, got {self.warmup_batches}")

    def _check_hot_tier_device(self):
        if self.hot_tier_device is None:
            return
        import tensorflow as tf
        try:
            spec = tf.DeviceSpec.from_string(self.hot_tier_device)
        except ValueError:
            spec = None
        # Physical devices: listing them does not start TensorFlow's runtime (which would
        # fix its threads and visible devices before the script sets them).
        seen = tf.config.list_physical_devices(spec.device_type) if spec and spec.device_type else []
        if not spec or (spec.device_index or 0) >= len(seen):
            raise ValueError(f"hot_tier_device is a device TensorFlow sees, such as '/CPU:0' or '/GPU:0', or None (a "
                             f"GPU if there is one); got {self.hot_tier_device!r}, and TensorFlow sees "
                             f"{[d.name for d in tf.config.list_physical_devices()]}")

    def _check_vocabulary_options(self):
        if isinstance(self.dynamic_vocabulary, int) and not isinstance(self.dynamic_vocabulary, bool):
            self.dynamic_vocabulary = bool(self.dynamic_vocabulary)     # PICASSO_DYNAMIC_VOCABULARY=1
        elif isinstance(self.dynamic_vocabulary, str):
            self.dynamic_vocabulary = tuple(f for f in self.dynamic_vocabulary.split(",") if f)
        if not isinstance(self.dynamic_vocabulary, bool):
            if not all(isinstance(f, str) for f in self.dynamic_vocabulary):
                raise ValueError(f"dynamic_vocabulary must be True, False or a list of feature names, got "
                                 f"{self.dynamic_vocabulary!r}")
            self.dynamic_vocabulary = tuple(self.dynamic_vocabulary)
        if self.vocabulary_capacity is not None and self.vocabulary_capacity < 1:
            raise ValueError(f"vocabulary_capacity is a number of keys >= 1 or None, got {self.vocabulary_capacity}")
        if self.admit_after < 1:
            raise ValueError(f"admit_after is a number of lookups >= 1, got {self.admit_after}")
        if self.admission_filter not in ("exact", "bloom") or self.bloom_filter_counters < 1:
            raise ValueError(f"admission_filter must be 'exact' or 'bloom' with bloom_filter_counters >= 1; got "
                             f"{self.admission_filter!r} and {self.bloom_filter_counters}")
        if self.eviction not in ("lfu", "ttl"):
            raise ValueError(f"eviction must be 'lfu' (the keys looked up least go) or 'ttl' (the keys not looked up "
                             f"in steps_to_live steps go first); got {self.eviction!r}")
        if (self.eviction == "ttl") != (self.steps_to_live is not None) or (
                self.steps_to_live is not None and self.steps_to_live < 1):
            raise ValueError(f"eviction='ttl' takes steps_to_live, a number of steps >= 1 (and only it does); got "
                             f"eviction={self.eviction!r}, steps_to_live={self.steps_to_live!r}")

    @classmethod
    def from_options(cls, **options):
        """Config from keyword options, with PICASSO_<OPTION> environment overrides
        (e.g. PICASSO_PACKING=0) so a script can be ablated without editing it."""
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - set(fields))
        if unknown:
            raise TypeError(f"unknown picasso_tf option(s) {unknown}; the options are {sorted(fields)}")
        values = dict(options)
        for name, field in fields.items():
            env = os.environ.get("PICASSO_" + name.upper())
            if env is not None:
                values[name] = _parse_env(name, env, field.type)
        return cls(**values)

    def pass_enabled(self, name):
        if name in ("d_packing", "k_packing"):
            return self.packing and getattr(self, name) and (name == "d_packing" or self.d_packing)
        if name == "dense_packing":
            return self.packing and self.dense_packing
        if name == "k_interleave":
            return self.interleaving
        return getattr(self, name)

    @property
    def lookahead_batches(self):
        """How many batches ahead a lookahead refresh of the hot set reads."""
        return self.hot_lookahead_batches or self.hot_refresh_every

    def to_dict(self):
        return dataclasses.asdict(self)


def _parse_env(name, text, type_name):
    if type_name in (bool, "bool"):
        if text.lower() in ("1", "true", "yes", "on"):
            return True
        if text.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"PICASSO_{name.upper()}={text!r}: expected 1/0, true/false")
    if type_name in (str, "str"):
        return text
    if type_name in (Optional[str], "Optional[str]"):
        return None if text.lower() in ("", "none") else text
    return float(text) if type_name in (float, "float") else int(text)
