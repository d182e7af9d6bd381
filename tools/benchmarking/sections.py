"""The sections of the benchmark suite (picasso-bench), one function each.

Every section takes the run's Sizes and a progress callback and returns a JSON-ready
dict {"title", "rows": [...], "notes": [...]}; a cell that cannot run records
"not built" (the feature or model does not exist yet) or "error: ..." in its row
instead of stopping the suite. Sections:

  packing     issue 4: wide LR / W&D on 200 one-hot fields, DLRM (Adagrad, exact Adam);
              baseline vs picasso_tf vs the dense-only bound, plus per-op breakdowns of
              the wide steps
  zoo         every zoo model on criteo-like and alibaba-like data (Fig. 10 / Table VII)
  auc         AUC parity, baseline vs picasso_tf (Table III)
  ablation    full vs packing=False vs dense_packing=False vs interleaving on vs hybrid_hash
              (Table IV)
  ops         training-step op counts and packed groups (Table V)
  scaling     duplicated feature fields 1x..kx against the arithmetic progression (Table VIII)
  hotstorage  HybridHash's hot tier on Zipf ids per size: hit ratio (Algorithm 1 beside LRU and
              the Belady bound) and samples/s against hybrid_hash=False (Table VI)
  deepctr     DeepCTR's models at their defaults on criteo-like data, per batch size, baseline vs
              picasso_tf vs the dense-only bound (issue 38; deepctr_models.py)
"""
import dataclasses
import time
import traceback
from typing import Dict, Optional, Tuple

import numpy as np
import tensorflow as tf

from picasso_tf.models.training import build_optimizer
from picasso_tf.tools.benchmarking import models as bm
from picasso_tf.tools.benchmarking.breakdown import op_breakdown
from picasso_tf.tools.benchmarking.stages import stage_times
from picasso_tf.tools.benchmarking.timing import Variant, in_memory_dataset, measure

SECTIONS = ("packing", "zoo", "auc", "ablation", "ops", "scaling", "hotstorage", "deepctr")
NOT_BUILT = "not built"
ZOO_DATASETS = ("criteo", "alibaba")     # the zoo section's data sets (picasso-bench --datasets)


@dataclasses.dataclass
class Sizes:
    """Problem sizes and repetitions of one mode (tiny / quick / full)."""
    seed: int = 0
    rounds: int = 15                      # packing rounds: enough short ones that a cell's median
                                          # percent-of-bound holds still on a noisy shared machine
    steps: int = 5
    warmup_steps: int = 2
    batches: int = 4                      # distinct pre-built batches each variant cycles through
    max_params: int = 200_000_000         # a model above this is skipped (memory: several copies per cell)
    # packing (issue 4)
    packing_configs: Tuple[str, ...] = ("wide_lr", "wide_wd", "dlrm_adagrad", "dlrm_adam")
    packing_fields: int = 200
    packing_vocab: int = 20_000
    packing_dims: Tuple[int, ...] = (8, 16, 32)
    packing_batch: int = 4096
    zipf: float = 1.2
    criteo_max_buckets: int = 100_000
    breakdown_steps: int = 3
    stage_repeats: int = 15               # isolated stage timings of the wide_lr step (0: skip)
    # zoo throughput
    zoo_models: Optional[Tuple[str, ...]] = None          # None: every model of the zoo
    zoo_datasets: Tuple[str, ...] = ZOO_DATASETS
    zoo_batch: int = 1024
    zoo_rounds: int = 5
    zoo_steps: int = 3
    min_window_s: float = 1.0             # each round of a timed cell lasts at least this (timing.measure)
    zoo_max_buckets: int = 100_000
    alibaba_onehot: int = 7
    alibaba_sequences: int = 6            # behaviour sequences of cat0..cat5; cat6 stays one-hot
    alibaba_small_vocab: int = 20         # cat6: a small-vocabulary field (StAR's domain indicator)
    alibaba_seq_len: int = 50
    alibaba_vocab: int = 100_000
    # AUC parity
    auc_models: Tuple[str, ...] = ("dlrm", "deepfm", "din", "dien")
    auc_datasets: Tuple[str, ...] = ("movielens", "synthetic")
    auc_rows: int = 40_000                 # synthetic examples (80% train, 20% test)
    auc_seq_len: int = 20                  # behaviour-sequence length of the synthetic alibaba-like AUC data
    auc_movielens_rows: Optional[int] = None   # None: all of MovieLens-100K
    auc_epochs: Optional[int] = None       # None: the model's recipe
    auc_vocab: int = 10_000
    # ablation
    ablation_models: Tuple[str, ...] = ("wide_deep", "can", "mmoe")
    ablation_batch: int = 1024
    ablation_scale: Dict[str, float] = dataclasses.field(
        default_factory=lambda: {"wide_deep": 1.0, "can": 0.2, "mmoe": 1.0})   # of the paper's field counts
    # op counts
    ops_models: Tuple[str, ...] = ("wide_deep", "can", "mmoe")
    ops_scale: float = 1.0                 # fraction of the paper's field counts
    can_feeders: int = 4
    # field scaling
    scaling_model: str = "can"
    scaling_multipliers: Tuple[int, ...] = (1, 2, 3, 4, 6, 8)
    scaling_base_onehot: int = 8
    scaling_base_sequences: int = 1
    scaling_batch: int = 1024
    scaling_vocab: int = 10_000
    # hot storage (Table VI): HybridHash's hot tier on a stream of Zipf ids. Its sizes are shares
    # of the stream's distinct ids: the paper's 256MB-4GB are shares of tables this machine lacks.
    hot_storage_sizes: Tuple[float, ...] = (0.01, 0.02, 0.05, 0.1, 0.2)
    hot_zipf: Tuple[float, ...] = (1.05, 1.2, 1.5)
    hot_vocab: int = 100_000
    hot_batch: int = 256                  # examples per step, hot_ids_per_example ids each
    hot_ids_per_example: int = 16
    hot_dim: int = 16
    hot_steps: int = 500                  # steps of the stream, the warm-up included
    hot_warmup: int = 100                 # Algorithm 1's warm-up steps (the paper's 100) ...
    hot_refresh: int = 100                # ... and steps between refreshes of the hot set
    # DeepCTR's models (deepctr_models.py; timed with zoo_rounds / zoo_steps)
    deepctr_models: Optional[Tuple[str, ...]] = None      # None: every model of deepctr_models.MODELS
    deepctr_batches: Tuple[int, ...] = (512, 4096)
    deepctr_vocab: int = 10_000


MODES = {
    "full": Sizes(),
    "quick": Sizes(rounds=3, steps=4, warmup_steps=2, batches=2, min_window_s=0.2, packing_fields=40,
                   packing_batch=2048,
                   breakdown_steps=2, stage_repeats=5, criteo_max_buckets=10_000,
                   zoo_models=("lr", "dlrm", "din"), zoo_batch=512, zoo_rounds=2, zoo_steps=3,
                   zoo_max_buckets=10_000, alibaba_seq_len=20, alibaba_vocab=10_000,
                   auc_models=("dlrm", "din"), auc_rows=10_000, auc_movielens_rows=20_000, auc_epochs=1,
                   auc_seq_len=10, ablation_models=("wide_deep",), ablation_batch=1024,
                   ablation_scale={"wide_deep": 0.25}, ops_models=("wide_deep", "mmoe"), ops_scale=0.25,
                   scaling_multipliers=(1, 2, 3), scaling_base_onehot=3, scaling_batch=512,
                   hot_storage_sizes=(0.01, 0.05, 0.2), hot_zipf=(1.05,), hot_steps=300,
                   deepctr_models=("WDL", "DeepFM", "DCN", "AutoInt"), deepctr_batches=(512, 2048)),
    "tiny": Sizes(rounds=2, steps=2, warmup_steps=2, batches=2, min_window_s=0.0,
                  packing_configs=("wide_lr", "dlrm_adagrad"),
                  packing_fields=6, packing_vocab=200, packing_batch=256, breakdown_steps=1, stage_repeats=2,
                  criteo_max_buckets=200, zoo_models=("lr",), zoo_datasets=("criteo",), zoo_batch=128,
                  zoo_rounds=1, zoo_steps=2, zoo_max_buckets=200, alibaba_seq_len=5, alibaba_vocab=200,
                  auc_models=("lr",), auc_datasets=("synthetic",), auc_rows=2000, auc_epochs=1, auc_vocab=200,
                  ablation_models=("wide_deep",), ablation_batch=128, ablation_scale={"wide_deep": 0.02},
                  ops_models=("mmoe",), ops_scale=0.05, scaling_model="lr", scaling_multipliers=(1, 2),
                  scaling_base_onehot=3, scaling_batch=128, scaling_vocab=200, hot_storage_sizes=(0.05,),
                  hot_zipf=(1.05,), hot_vocab=2000, hot_batch=32, hot_ids_per_example=4, hot_steps=12,
                  hot_warmup=4, hot_refresh=4, deepctr_models=("PNN",), deepctr_batches=(64,), deepctr_vocab=200),
}


# -- helpers ----------------------------------------------------------------------------------

def rss_gib():
    """This process's resident memory (GiB), from /proc (None elsewhere)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 2 ** 20
    except OSError:
        pass
    return None


def cleanup():
    """Frees the models of a finished cell: Keras models are full of reference cycles and
    their traced functions hold the variables, so without this a long run grows by
    every model it ever built."""
    import gc
    tf.keras.backend.clear_session()
    gc.collect()


class NotApplicable(ValueError):
    """The model cannot run on this data (e.g. it needs behaviour sequences)."""


def _error(exc):
    if isinstance(exc, NotImplementedError):
        return f"{NOT_BUILT}: {exc}"
    if isinstance(exc, NotApplicable):
        return f"n/a: {exc}"
    return f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"


def _zoo():
    try:
        from picasso_tf import models as zoo
        return zoo
    except Exception:     # the zoo may still be landing
        return None


def _fresh_optimizer(name, learning_rate=None):
    if name == "adagrad":
        return tf.keras.optimizers.Adagrad(learning_rate or 0.01)
    if name == "adam":
        return tf.keras.optimizers.Adam(learning_rate or 0.001)
    if name == "sgd":
        return tf.keras.optimizers.SGD(learning_rate or 0.01)
    raise ValueError(f"unknown optimizer {name!r}")


def _compile(model, optimizer):
    model.compile(optimizer=_fresh_optimizer(optimizer), loss="binary_crossentropy")
    build_optimizer(model)
    return model


def _picasso(model, example, warmup, **options):
    import picasso_tf
    return picasso_tf.optimize(model, example_inputs=example, warmup_data=warmup, **options)


@dataclasses.dataclass
class Trio:
    """A baseline model, its picasso_tf copy (same initial weights) and optionally the
    dense-only bound, compiled with fresh instances of one optimizer."""
    variants: list
    info: Dict


def build_trio(build, data, batch_size, optimizer, sizes, with_bound=True, options=None, extra=None):
    """Builds baseline / picasso (/ bound) of `build()` on `data`; the variants dict is
    ready for measure(). `extra`: {name: picasso options} for more picasso variants."""
    tf.keras.utils.set_random_seed(sizes.seed)
    base = build()
    params = sum(int(np.prod(w.shape)) for w in base.weights)
    if params > sizes.max_params:
        raise NotApplicable(f"{params:,} parameters: above the suite's limit of {sizes.max_params:,} "
                            "(each cell holds several copies of the model and its optimizer slots)")
    copies = {}
    source = bm.batches(data, base, batch_size, sizes.batches)
    warmup = _batches_dataset(source)
    info = {}
    variants = [Variant("baseline", _compile(base, optimizer), in_memory_dataset(source), batch_size)]
    for name, opts in {"picasso": options or {}, **(extra or {})}.items():
        copy = build()
        copy.set_weights(base.get_weights())
        start = time.perf_counter()
        try:
            pic = _picasso(copy, source[0][0], warmup, **opts)
        except Exception as e:     # noqa: BLE001  (recorded in the row)
            info[f"{name}_error"] = _error(e)
            continue
        info[f"{name}_optimize_s"] = time.perf_counter() - start
        copies[name] = (copy, pic)
        variants.append(Variant(name, _compile(pic, optimizer), in_memory_dataset(source), batch_size))
    if "picasso" in copies:
        copy, pic = copies["picasso"]
        info["packed_groups"] = len(pic.picasso.storages)
        info["embedding_tables"] = len(pic.picasso.table_variables) - len(pic.picasso.storages)
        report = pic.picasso.reports.get("training", {})
        info["embedding_sites"] = len(report.get("analysis", {}).get("sites", []))
        info["left_alone"] = len(report.get("analysis", {}).get("left_alone", []))
        if with_bound:
            try:
                third = build()
                tables = bm.corresponding_variables(copy, bm.analysed_tables(pic.picasso.program), third)
                bound, width = bm.dense_only(third, tables)
                info["bound_input_width"] = width
                variants.append(Variant("bound", _compile(bound, optimizer),
                                        in_memory_dataset(bm.bound_batches(bound, width, source, sizes.seed)),
                                        batch_size))
            except bm.NotGeneric as e:
                info["bound_error"] = f"not generic: {e}"
            except Exception as e:    # noqa: BLE001
                info["bound_error"] = _error(e)
    return Trio(variants, info), copies


def _batches_dataset(source):
    ds = tf.data.Dataset.from_tensors(source[0])
    for b in source[1:]:
        ds = ds.concatenate(tf.data.Dataset.from_tensors(b))
    return ds


def _optimizer_note(trio_variants):
    for v in trio_variants:
        info = getattr(v.model, "picasso", None)
        if info is not None and v.name == "picasso":
            return info.optimizer_note
    return None


def _timed_row(name, trio, sizes, progress, rounds=None, steps=None, **fields):
    pairs = [("picasso", "baseline"), ("picasso", "bound"), ("baseline", "bound")]
    names = [v.name for v in trio.variants]
    for extra in names:
        if extra not in ("baseline", "picasso", "bound"):
            pairs += [(extra, other) for other in ("baseline", "bound") if other in names]
    result = measure(trio.variants, rounds or sizes.rounds, steps or sizes.steps, sizes.warmup_steps,
                     pairs=pairs, progress=lambda m: progress(f"{name}: {m}"), min_window_s=sizes.min_window_s)
    row = {"name": name, **fields, **trio.info, **result}
    row["optimizer_note"] = _optimizer_note(trio.variants)
    row["rss_gib"] = rss_gib()
    return row


# -- schemas and data -------------------------------------------------------------------------

def wide_data(sizes, rows, fields=None, vocab=None, seed=None):
    from picasso_tf.data import generate, wide_schema
    schema = wide_schema(num_fields=fields or sizes.packing_fields, vocab_size=vocab or sizes.packing_vocab,
                         embedding_dims=sizes.packing_dims)
    return generate(schema, rows, seed=sizes.seed if seed is None else seed, zipf_exponent=sizes.zipf)


def criteo_data(sizes, rows, max_buckets, seed=None):
    from picasso_tf.data import criteo_schema, generate
    return generate(criteo_schema(max_buckets=max_buckets), rows, seed=sizes.seed if seed is None else seed,
                    zipf_exponent=sizes.zipf)


def alibaba_data(sizes, rows, vocab=None, seed=None):
    from picasso_tf.data import alibaba_schema, generate
    vocab = vocab or sizes.alibaba_vocab
    vocab_sizes = [vocab] * (sizes.alibaba_onehot - 1) + [min(vocab, sizes.alibaba_small_vocab)]
    schema = alibaba_schema(num_onehot=sizes.alibaba_onehot, num_sequences=sizes.alibaba_sequences,
                            seq_len=sizes.alibaba_seq_len, vocab_size=vocab_sizes)
    return generate(schema, rows, seed=sizes.seed if seed is None else seed, zipf_exponent=sizes.zipf)


def synthetic_schema(n_dense, n_onehot, n_sequences, seq_len, dims, vocab, labels=("label",), name="synthetic"):
    """n_dense dense, n_onehot one-hot (dims cycling) and n_sequences behaviour sequences,
    sequence j sharing the group (table) of one-hot feature j."""
    from picasso_tf.data import CATEGORICAL, DENSE, SEQUENCE, Feature, Schema
    n_sequences = min(n_sequences, n_onehot)
    features = [Feature(f"d{i}", DENSE) for i in range(n_dense)]
    features += [Feature(f"c{i}", CATEGORICAL, vocab_size=vocab, embedding_dim=dims[i % len(dims)],
                         group=f"c{i}" if i < n_sequences else None) for i in range(n_onehot)]
    features += [Feature(f"s{j}", SEQUENCE, vocab_size=vocab, max_len=seq_len, embedding_dim=dims[j % len(dims)],
                         group=f"c{j}") for j in range(n_sequences)]
    return Schema(features, labels=list(labels), name=name)


# Table V's models: (dense, one-hot, sequences, sequence length, embedding dims, labels), the
# paper's Product-1/2/3 layouts (Table II): 204 / 334 + 30 / 84 + 10 fields.
PAPER_LAYOUTS = {
    "wide_deep": (10, 204, 0, 0, (8, 16, 32), ("label",)),
    "can": (0, 334, 30, 50, (8, 16, 32, 64), ("label",)),
    "mmoe": (0, 84, 10, 50, (12, 16, 32, 64, 128), ("ctr", "cvr")),
}


def paper_schema(model, scale=1.0, vocab=1000, seq_len=None):
    n_dense, n_onehot, n_seq, length, dims, labels = PAPER_LAYOUTS[model]
    n_onehot = max(2, round(n_onehot * scale))
    n_seq = min(n_onehot, round(n_seq * scale)) if n_seq else 0
    return synthetic_schema(n_dense, n_onehot, n_seq, seq_len or length, dims, vocab, labels,
                            name=f"{model}_layout")


def zoo_builder(name, schema, data, sizes, limit_feeders=False, **hparams):
    """A no-argument builder of zoo model `name` for schema (the zoo's default hparams).
    limit_feeders: CAN co-acts each target with every other field by default, which for
    hundreds of fields makes tens of thousands of units; with it, the first
    sizes.can_feeders non-behaviour fields are the feeders."""
    zoo = _zoo()
    if zoo is None or name not in zoo.list():
        raise NotImplementedError(f"zoo model {name!r} is not in picasso_tf.models")
    missing = zoo.missing_inputs(name, schema)
    if missing:
        raise NotApplicable(f"the data lacks {'; '.join(missing)}")
    info = zoo.info(name)
    params = dict(info.prepare(schema, data.features)) if info.prepare else {}
    if name == "can" and limit_feeders and "feeders" not in hparams:
        others = [f.name for f in schema.categorical if f.name not in _behaviour_names(schema)]
        hparams["feeders"] = others[:sizes.can_feeders]
    params.update(hparams)
    return lambda: info.builder(schema, **params)


def _behaviour_names(schema):
    from picasso_tf.models import inputs as zin
    return zin.behaviour_names(schema)


# -- sections ---------------------------------------------------------------------------------

def run_packing(sizes, progress):
    """Issue 4's packing benchmark (batch packing_batch): see the module docstring."""
    out = {"title": "Packing benchmark (issue 4)", "rows": [], "notes": [], "breakdowns": {},
           "batch_size": sizes.packing_batch}
    rows_needed = sizes.packing_batch * sizes.batches
    wide = criteo = None
    for config in sizes.packing_configs:
        progress(f"packing {config}: building")
        try:
            if config.startswith("wide"):
                wide = wide or wide_data(sizes, rows_needed)
                data = wide
                builder = bm.build_wide_lr if config == "wide_lr" else bm.build_wide_wd
                build = (lambda b=builder, s=data.schema: b(s))
                optimizer = "adagrad"
                desc = (f"{sizes.packing_fields} one-hot fields, dims {'/'.join(map(str, sizes.packing_dims))}, "
                        f"vocab {sizes.packing_vocab:,}, Zipf {sizes.zipf}; "
                        + ("one sigmoid unit on the concatenation" if config == "wide_lr" else "MLP 256-128"))
            else:
                criteo = criteo or criteo_data(sizes, rows_needed, sizes.criteo_max_buckets)
                data = criteo
                build = zoo_builder("dlrm", data.schema, data, sizes)
                optimizer = "adagrad" if config.endswith("adagrad") else "adam"
                desc = (f"zoo dlrm, criteo-like: 26 fields dim 16 (buckets <= {sizes.criteo_max_buckets:,}), "
                        f"13 dense")
            # DLRM's dot interaction is dense compute that the interactions pass also
            # speeds up: the extra variant without it shows the embedding layer's cost alone.
            extra = {} if config.startswith("wide") else {"no_interactions": {"interactions": False}}
            trio, copies = build_trio(build, data, sizes.packing_batch, optimizer, sizes, extra=extra)
            row = _timed_row(config, trio, sizes, progress, model=config, optimizer=optimizer +
                             (" (exact)" if optimizer == "adam" else ""), description=desc)
            out["rows"].append(row)
            if config.startswith("wide") and sizes.breakdown_steps:
                progress(f"packing {config}: per-op breakdown (profiler trace)")
                breakdown = {v.name: op_breakdown(v.model, v.dataset, sizes.breakdown_steps)
                             for v in trio.variants}
                breakdown.update(fields=sizes.packing_fields, batch_size=sizes.packing_batch)
                out["breakdowns"][config] = breakdown
            if config == "wide_lr" and sizes.stage_repeats and "picasso" in copies:
                progress("packing wide_lr: stages timed in isolation")
                copy, pic = copies["picasso"]
                tables = [copy.get_layer(f"emb_{f.name}").embeddings for f in data.schema.categorical]
                out["stages"] = stage_times(data.schema, data.features, data.labels, sizes.packing_batch,
                                            pic.picasso.program.tables, tables, repeats=sizes.stage_repeats, seed=sizes.seed)
            del trio, copies
        except Exception as e:       # noqa: BLE001
            out["rows"].append({"name": config, "model": config, "error": _error(e),
                                "trace": traceback.format_exc(limit=3)})
        cleanup()
    out["notes"].append("bound = the same model fed its lookups' outputs as one dense [B, sum(dims)] input "
                        "(no embeddings; the loss's gradient with respect to it is still taken, as a model whose "
                        "tables train needs it); % of bound = picasso samples/s / bound samples/s. no_interactions = "
                        "picasso with interactions=False: its dense part is the bound's, so its % of bound is "
                        "the cost of the embedding layer alone.")
    return out


def run_zoo(sizes, progress):
    zoo = _zoo()
    out = {"title": "Zoo throughput (Fig. 10 / Table VII)", "rows": [], "notes": [],
           "batch_size": sizes.zoo_batch}
    if zoo is None:
        out["notes"].append(f"{NOT_BUILT}: picasso_tf.models cannot be imported")
        return out
    names = sizes.zoo_models or tuple(zoo.list())
    rows_needed = sizes.zoo_batch * sizes.batches
    for dataset in sizes.zoo_datasets:
        progress(f"zoo {dataset}: generating data")
        data = criteo_data(sizes, rows_needed, sizes.zoo_max_buckets) if dataset == "criteo" \
            else alibaba_data(sizes, rows_needed)
        for name in names:
            progress(f"zoo {dataset} {name}: building")
            try:
                build = zoo_builder(name, data.schema, data, sizes)
                trio, _ = build_trio(build, data, sizes.zoo_batch, "adagrad", sizes)
                out["rows"].append(_timed_row(f"{dataset}/{name}", trio, sizes, progress, rounds=sizes.zoo_rounds,
                                              steps=sizes.zoo_steps, model=name, dataset=dataset))
                del trio
            except Exception as e:   # noqa: BLE001
                out["rows"].append({"name": f"{dataset}/{name}", "model": name, "dataset": dataset,
                                    "error": _error(e)})
            cleanup()
    out["notes"].append(
        f"criteo-like: the synthetic criteo preset, 26 fields (buckets <= {sizes.zoo_max_buckets:,}) + 13 dense; "
        f"alibaba-like: the alibaba preset with {sizes.alibaba_onehot} one-hot fields (vocab {sizes.alibaba_vocab:,}, "
        f"the last {sizes.alibaba_small_vocab}) and {sizes.alibaba_sequences} behaviour sequences of "
        f"{sizes.alibaba_seq_len} ids (one per one-hot group: the zoo's DIN-style models build one table per "
        f"group and fail on the preset's default 12 sequences over 7 groups). Zoo default hyper-parameters; "
        f"Adagrad(0.01) for all; a model above {sizes.max_params:,} parameters is skipped.")
    return out


def run_auc(sizes, progress):
    zoo = _zoo()
    out = {"title": "AUC parity (Table III)", "rows": [], "notes": []}
    if zoo is None:
        out["notes"].append(f"{NOT_BUILT}: picasso_tf.models cannot be imported")
        return out
    from picasso_tf.data import load_movielens
    for dataset in sizes.auc_datasets:
        for name in sizes.auc_models:
            progress(f"auc {dataset} {name}")
            row = {"name": f"{dataset}/{name}", "model": name, "dataset": dataset}
            try:
                train, test, planted = _auc_data(name, dataset, sizes, load_movielens)
                row["train_examples"], row["test_examples"] = train.num_examples, test.num_examples
                if planted is not None:
                    row["planted_auc"] = zoo.auc(test.labels, planted)
                overrides = {"epochs": sizes.auc_epochs} if sizes.auc_epochs else {}
                for variant, wrap in (("baseline", None), ("picasso", _optimize_named)):
                    result = zoo.build_and_train(name, train, test, seed=sizes.seed, wrap=wrap, **overrides)
                    row[f"{variant}_auc"] = result.test_auc
                    row[f"{variant}_train_s"] = result.train_seconds
                    row[f"{variant}_loss"] = float(result.history["loss"][-1]) if result.history.get("loss") else None
                    row["recipe"] = result.recipe
                row["auc_diff"] = row["picasso_auc"] - row["baseline_auc"]
            except Exception as e:   # noqa: BLE001
                row["error"] = _error(e)
            out["rows"].append(row)
            cleanup()
    out["notes"].append("Both variants: the zoo recipe (optimizer, learning rate, epochs, batch), the same seed "
                        "(same initial weights and data order); picasso = picasso_tf.optimize on the built model. "
                        "Data: MovieLens-100K (random 80/20 split, label rating >= 4); synthetic = the criteo-like "
                        f"preset (buckets <= {sizes.auc_vocab:,}) for DLRM/DeepFM and the alibaba-like one "
                        f"(sequences of {sizes.auc_seq_len}, vocab {sizes.auc_vocab:,}) for DIN/DIEN, "
                        f"{sizes.auc_rows:,} examples split 80/20; planted-model AUC = the generator's own "
                        "probabilities on the test split (the ceiling).")
    return out


def _optimize_named(model):
    """picasso_tf.optimize, with output_names copied from the original model: the zoo's
    training helper reads model.output_names, which a subclassed keras.Model (as
    PicassoModel is) only gets once called."""
    import picasso_tf
    wrapped = picasso_tf.optimize(model)
    wrapped.output_names = list(model.output_names)
    return wrapped


def _auc_data(name, dataset, sizes, load_movielens):
    if dataset == "movielens":
        train, test = load_movielens(seed=sizes.seed)
        if sizes.auc_movielens_rows:
            train = train.take(np.arange(min(sizes.auc_movielens_rows, train.num_examples)))
            test = test.take(np.arange(min(sizes.auc_movielens_rows // 4, test.num_examples)))
        return train, test, None
    behaviour = name in ("din", "dien", "dsin", "atbrg")
    if behaviour:
        data = alibaba_data(dataclasses.replace(sizes, alibaba_seq_len=sizes.auc_seq_len), sizes.auc_rows,
                            vocab=sizes.auc_vocab, seed=sizes.seed + 1)
    else:
        data = criteo_data(sizes, sizes.auc_rows, sizes.auc_vocab, seed=sizes.seed + 1)
    train, test = data.split(0.2, seed=sizes.seed)
    planted = test.extras.get("planted_probability")
    return train, test, planted


def run_ablation(sizes, progress):
    out = {"title": "Ablation (Table IV)", "rows": [], "notes": [], "batch_size": sizes.ablation_batch}
    extra = {"packing=False": {"packing": False}, "dense_packing=False": {"dense_packing": False},
             "micro_batches=2,interleave_groups=2": {"micro_batches": 2, "interleave_groups": 2},
             "hybrid_hash=True": {"hybrid_hash": True}}
    for model in sizes.ablation_models:
        progress(f"ablation {model}: building")
        try:
            from picasso_tf.data import generate
            schema = paper_schema(model, sizes.ablation_scale.get(model, 1.0), vocab=sizes.scaling_vocab,
                                  seq_len=sizes.alibaba_seq_len)
            data = generate(schema, sizes.ablation_batch * sizes.batches, seed=sizes.seed, zipf_exponent=sizes.zipf)
            build = zoo_builder(model, schema, data, sizes, limit_feeders=True)
            trio, _ = build_trio(build, data, sizes.ablation_batch, "adagrad", sizes, with_bound=False, extra=extra)
            row = _timed_row(model, trio, sizes, progress, rounds=sizes.zoo_rounds, steps=sizes.zoo_steps,
                             model=model, fields=len(schema.categorical) + len(schema.sequences))
            for name in extra:
                if f"{name}_error" in row:
                    row[f"{name}_status"] = row[f"{name}_error"]
            out["rows"].append(row)
            del trio
        except Exception as e:       # noqa: BLE001
            out["rows"].append({"name": model, "model": model, "error": _error(e)})
        cleanup()
    out["notes"].append("Interleaving is off by default (micro_batches=1, interleave_groups=1: on this CPU neither "
                        "makes a step faster, benchmarks/interleaving_sweep.txt), so Table IV's \"w/o interleaving\" "
                        "would run the full configuration's graph; its column here turns interleaving on instead "
                        "(two micro-batches from the embedding, two interleaving groups). hybrid_hash=True keeps the "
                        "packed groups in hash tables behind the default hot tier (hot_storage_bytes, refreshed every "
                        "100 steps; on this CPU both tiers sit in the same memory). "
                        "Schemas: the paper's layouts (see ops) scaled by "
                        + ", ".join(f"{m} {sizes.ablation_scale.get(m, 1.0):g}" for m in sizes.ablation_models)
                        + f"; vocabulary {sizes.scaling_vocab:,}, sequences of {sizes.alibaba_seq_len}.")
    return out


def run_ops(sizes, progress):
    import picasso_tf
    from picasso_tf.data import generate
    out = {"title": "Operation counts (Table V)", "rows": [], "notes": []}
    for model in sizes.ops_models:
        progress(f"ops {model}: building and profiling")
        row = {"name": model, "model": model}
        try:
            schema = paper_schema(model, sizes.ops_scale)
            row["fields"] = len(schema.categorical) + len(schema.sequences)
            data = generate(schema, 64, seed=sizes.seed)
            build = zoo_builder(model, schema, data, sizes, limit_feeders=True)
            start = time.perf_counter()
            keras_model = build()
            x = {k: tf.constant(v) for k, v in data.features.items()}
            y = tf.nest.map_structure(tf.constant, bm.targets(keras_model, data.label_dict))
            pic = picasso_tf.optimize(keras_model, example_inputs=x)
            pic.compile(optimizer=tf.keras.optimizers.Adagrad(0.01), loss="binary_crossentropy")
            report = picasso_tf.profile(pic, (x, y))
            row.update({
                "step_ops_baseline": report["ops"]["step_baseline"]["total"],
                "step_ops_picasso": report["ops"]["step_picasso"]["total"],
                "forward_ops_baseline": report["ops"]["forward_baseline"]["total"],
                "forward_ops_picasso": report["ops"]["forward_picasso"]["total"],
                "step_op_ratio": report["step_op_ratio"],
                "embedding_sites": report["embedding_sites"],
                "embedding_tables": len(pic.picasso.table_variables) - report["packed_groups"],
                "packed_groups": report["packed_groups"],
                "left_alone": len(report["left_alone"]),
                "by_class_baseline": report["ops"]["step_baseline"]["by_class"],
                "by_class_picasso": report["ops"]["step_picasso"]["by_class"],
                "seconds": time.perf_counter() - start,
            })
        except Exception as e:       # noqa: BLE001
            row["error"] = _error(e)
        out["rows"].append(row)
        cleanup()
    out["notes"].append("Ops of the whole training step (forward, tf.gradients/GradientTape backward, optimizer "
                        "apply), functions included, as picasso_tf.profile counts them. Schemas: the paper's "
                        "field layouts (Table II) scaled by " + f"{sizes.ops_scale:g}" + ": W&D 10 dense + 204 "
                        "one-hot (dims 8/16/32); CAN 334 one-hot + 30 behaviour sequences (dims 8-64), each "
                        f"behaviour pair co-acting with {sizes.can_feeders} feeder fields; MMoE 84 one-hot + 10 "
                        "sequences (dims 12-128), two tasks. Vocabulary 1,000 per field (counts do not depend on it).")
    return out


def run_scaling(sizes, progress):
    from picasso_tf.data import generate
    out = {"title": "Feature-field scaling (Table VIII)", "rows": [], "notes": [], "model": sizes.scaling_model,
           "batch_size": sizes.scaling_batch}
    variants, meta = [], {}
    try:
        for k in sizes.scaling_multipliers:
            progress(f"scaling {k}x: building")
            schema = synthetic_schema(0, sizes.scaling_base_onehot * k, sizes.scaling_base_sequences * k,
                                      sizes.alibaba_seq_len, (8, 16), sizes.scaling_vocab, name=f"x{k}")
            data = generate(schema, sizes.scaling_batch * sizes.batches, seed=sizes.seed, zipf_exponent=sizes.zipf)
            # CAN: every behaviour pair co-acts with the same few feeder fields, so the
            # interaction units grow linearly with k (k pairs x can_feeders).
            build = zoo_builder(sizes.scaling_model, schema, data, sizes, limit_feeders=True)
            trio, _ = build_trio(build, data, sizes.scaling_batch, "adagrad", sizes, with_bound=False)
            for v in trio.variants:
                v.name = f"{v.name}@{k}x"
                variants.append(v)
            meta[k] = {"fields": len(schema.categorical) + len(schema.sequences), **trio.info}
        result = measure(variants, sizes.zoo_rounds, sizes.zoo_steps, sizes.warmup_steps,
                         pairs=[(f"picasso@{k}x", f"baseline@{k}x") for k in sizes.scaling_multipliers],
                         progress=lambda m: progress(f"scaling: {m}"), min_window_s=sizes.min_window_s)
    except Exception as e:           # noqa: BLE001
        out["error"] = _error(e)
        return out
    first = sizes.scaling_multipliers[0]
    for k in sizes.scaling_multipliers:
        row = {"multiplier": k, **meta[k]}
        for system in ("baseline", "picasso"):
            ips = result["variants"][f"{system}@{k}x"]["samples_per_s"]
            ap = result["variants"][f"{system}@{first}x"]["samples_per_s"] * first / k
            row[system] = {"samples_per_s": ips, "ap": ap, "increment": ips / ap - 1.0,
                           "min": result["variants"][f"{system}@{k}x"]["samples_per_s_min"],
                           "max": result["variants"][f"{system}@{k}x"]["samples_per_s_max"]}
        row["ratio"] = result["ratios"][f"picasso@{k}x/baseline@{k}x"]
        out["rows"].append(row)
    out["load_average"] = result["load_average"]
    out["rounds"], out["steps"] = result["rounds"], result["steps"]
    out["notes"].append(f"{sizes.scaling_model} on k copies of a base of {sizes.scaling_base_onehot} one-hot + "
                        f"{sizes.scaling_base_sequences} behaviour sequence fields; AP = throughput at "
                        f"{first}x times {first}/k. All multipliers and both systems timed interleaved in one run.")
    return out


# -- HybridHash's hot tier (Table VI) ---------------------------------------------------------
#
# A hit is one of a step's distinct ids that the cache held when the step began; a hit ratio is
# hits over distinct ids, both summed over the steps after Algorithm 1's warm-up. The storage
# counts exactly that (picasso_tf.embedding.hot_tier), and every cache below is measured so.

def zipf_stream(steps, batch, width, vocab, exponent, seed):
    """[steps, batch, width] ids in [0, vocab): ranks drawn with P(rank r) ~ r^-exponent, mapped
    to ids by a fixed random permutation, so that popularity has nothing to do with the order
    of the ids (Algorithm 1 breaks ties by the smaller id)."""
    rng = np.random.default_rng(seed)
    cdf = np.cumsum(np.arange(1, vocab + 1, dtype=np.float64) ** -exponent)
    ranks = np.minimum(np.searchsorted(cdf, rng.random((steps, batch, width)) * cdf[-1]), vocab - 1)
    return rng.permutation(vocab)[ranks]


def algorithm1_hits(distinct, vocab, capacity, warmup, refresh_every):
    """Per step, the hits of Algorithm 1 in NumPy (a check of the storage's counters): each
    step's distinct ids counted once; after `warmup` steps and every `refresh_every` after,
    the tier holds the `capacity` ids of highest count (ties: the smaller id)."""
    counts, held, hits = np.zeros(vocab, np.int64), np.zeros(vocab, bool), []
    for step, ids in enumerate(distinct):
        hits.append(int(held[ids].sum()))
        counts[ids] += 1
        done = step + 1 - warmup
        if done >= 0 and done % refresh_every == 0:
            held[:] = False
            held[np.lexsort((np.arange(vocab), -counts))[:capacity]] = True
    return np.array(hits)


def lru_hits(stream, vocab, capacity):
    """Per step, the hits of an LRU cache of `capacity` ids fed the stream's ids in order:
    after each step it holds the `capacity` ids looked up most recently."""
    last, held, hits, clock = np.full(vocab, -1, np.int64), np.zeros(vocab, bool), [], 0
    for batch in stream:
        flat = batch.ravel()
        ids, from_end = np.unique(flat[::-1], return_index=True)
        hits.append(int(held[ids].sum()))
        last[ids] = clock + flat.size - 1 - from_end      # each id's last position in the stream
        clock += flat.size
        seen = np.flatnonzero(last >= 0)
        kept = seen if seen.size <= capacity else seen[np.argpartition(-last[seen], capacity - 1)[:capacity]]
        held[:] = False
        held[kept] = True
    return np.array(hits)


def belady_hits(distinct, vocab, capacity):
    """Per step, the hits of Belady's MIN (clairvoyant): after each step the cache keeps, of
    what it held and the step's ids, the `capacity` ids looked up again soonest (none that
    is never looked up again). The most hits of any cache that takes an id in only when a
    step looks it up."""
    never = np.iinfo(np.int64).max
    upcoming, following = np.full(vocab, never, np.int64), [None] * len(distinct)
    for step in range(len(distinct) - 1, -1, -1):      # the next step that looks each id up
        following[step] = upcoming[distinct[step]]
        upcoming[distinct[step]] = step
    next_use, held, cache, hits = np.full(vocab, never, np.int64), np.zeros(vocab, bool), np.zeros(0, np.int64), []
    for step, ids in enumerate(distinct):
        hits.append(int(held[ids].sum()))
        next_use[ids] = following[step]
        candidates = np.union1d(cache, ids)
        candidates = candidates[next_use[candidates] != never]
        if candidates.size > capacity:
            candidates = candidates[np.argpartition(next_use[candidates], capacity - 1)[:capacity]]
        held[cache] = False
        cache = candidates
        held[cache] = True
    return np.array(hits)


def best_fixed_set_hits(distinct, vocab, capacity, first):
    """Per step, the hits of holding, throughout, the `capacity` ids looked up in most of the
    steps from `first` on (clairvoyant: the set that Algorithm 1's past counts estimate)."""
    counts = np.zeros(vocab, np.int64)
    for ids in distinct[first:]:
        counts[ids] += 1
    held = np.zeros(vocab, bool)
    held[np.argsort(-counts, kind="stable")[:capacity]] = True
    return np.array([int(held[ids].sum()) for ids in distinct])


def _hot_tier_model(sizes):
    """One embedding table looked up by hot_ids_per_example ids per example, averaged, and a
    sigmoid unit: one packed group, so the hot tier gets the whole hot_storage_bytes."""
    tf.keras.utils.set_random_seed(sizes.seed)
    ids = tf.keras.Input((sizes.hot_ids_per_example,), dtype="int64", name="ids")
    pooled = tf.keras.layers.GlobalAveragePooling1D()(tf.keras.layers.Embedding(sizes.hot_vocab, sizes.hot_dim)(ids))
    return tf.keras.Model(ids, tf.keras.layers.Dense(1, activation="sigmoid")(pooled))


def _hot_counters(model):
    (storage,) = model.picasso.storages.values()
    return int(storage.hot.hits.numpy()), int(storage.hot.lookups.numpy())


def hot_tier_sweep(sizes, exponent, progress):
    """Table VI for one Zipf exponent: a row per model (hybrid_hash=False, no hot tier, and a
    hot tier of each share of the stream's distinct ids) with samples/s against
    hybrid_hash=False (timed interleaved after the stream); the hot tiers' rows also carry the
    hit ratios of Algorithm 1 (the storage's counters over the stream), LRU, Belady and the
    best fixed set on the same stream."""
    import picasso_tf
    stream = zipf_stream(sizes.hot_steps + sizes.batches, sizes.hot_batch, sizes.hot_ids_per_example,
                         sizes.hot_vocab, exponent, sizes.seed)
    labels = (np.random.default_rng(sizes.seed).random(stream.shape[:2]) < 0.5).astype("float32")
    stream, timed, timed_labels = stream[:sizes.hot_steps], stream[sizes.hot_steps:], labels[sizes.hot_steps:]
    distinct = [np.unique(b) for b in stream]
    seen, first = int(np.unique(stream).size), sizes.hot_warmup
    looked_up = sum(ids.size for ids in distinct[first:])
    common = {"zipf": exponent, "distinct_ids": seen, "distinct_per_step": float(np.mean([d.size for d in distinct])),
              "steps": sizes.hot_steps, "warmup": sizes.hot_warmup, "refresh_every": sizes.hot_refresh}
    row_bytes = 2 * sizes.hot_dim * 4 + 16   # values, Adagrad slot, key, count: as passes/hybrid_hash.hot_rows counts
    options = {"hybrid_hash=False": {}, "no hot tier": {"hybrid_hash": True, "hot_storage_bytes": 0}}
    rows = {"hybrid_hash=False": {}, "no hot tier": {"share": 0.0, "hot_rows": 0}}
    for share in sizes.hot_storage_sizes:
        capacity = max(1, round(share * seen))
        name = f"hot tier {100 * share:g}%"
        options[name] = {"hybrid_hash": True, "hot_storage_bytes": capacity * row_bytes,
                         "hot_warmup_steps": sizes.hot_warmup, "hot_refresh_every": sizes.hot_refresh}
        rows[name] = {"share": share, "hot_rows": capacity, "hot_bytes": capacity * row_bytes}
    base = _hot_tier_model(sizes)
    data = tf.data.Dataset.from_tensor_slices(({"ids": stream}, labels[:sizes.hot_steps]))
    variants = []
    for name, opts in options.items():
        progress(f"hotstorage zipf {exponent}: {name} on the stream")
        copy = _hot_tier_model(sizes)
        copy.set_weights(base.get_weights())
        model = _compile(picasso_tf.optimize(copy, **opts), "adagrad")
        model.fit(data.take(first), verbose=0)
        capacity = rows[name].get("hot_rows")
        if capacity:
            (storage,) = model.picasso.storages.values()
            if storage.hot.capacity != capacity:
                raise AssertionError(f"{name}: the hot tier holds {storage.hot.capacity} rows, not {capacity}")
            before = _hot_counters(model)
        model.fit(data.skip(first), verbose=0)
        if capacity:
            hits, lookups = (b - a for a, b in zip(before, _hot_counters(model)))
            rows[name].update(
                algorithm1=hits / lookups,
                algorithm1_numpy=float(algorithm1_hits(distinct, sizes.hot_vocab, capacity, sizes.hot_warmup,
                                                       sizes.hot_refresh)[first:].sum()) / looked_up,
                lru=float(lru_hits(stream, sizes.hot_vocab, capacity)[first:].sum()) / looked_up,
                belady=float(belady_hits(distinct, sizes.hot_vocab, capacity)[first:].sum()) / looked_up,
                best_fixed_set=float(best_fixed_set_hits(distinct, sizes.hot_vocab, capacity, first)[first:].sum())
                / looked_up)
            rows[name]["algorithm1/belady"] = rows[name]["algorithm1"] / rows[name]["belady"]
        variants.append(Variant(name, model, in_memory_dataset(
            [({"ids": tf.constant(x)}, tf.constant(y)) for x, y in zip(timed, timed_labels)]), sizes.hot_batch))
    counters = {v.name: _hot_counters(v.model) for v in variants if rows[v.name].get("hot_rows")}
    result = measure(variants, sizes.rounds, sizes.steps, sizes.warmup_steps,
                     pairs=[(v.name, "hybrid_hash=False") for v in variants[1:]],
                     progress=lambda m: progress(f"hotstorage zipf {exponent}: {m}"),
                     min_window_s=sizes.min_window_s)
    out = []
    for v in variants:
        row = {"name": f"zipf {exponent}, {v.name}", "variant": v.name, **common, **rows[v.name],
               **result["variants"][v.name], "load_average": result["load_average"],
               "rounds": result["rounds"], "timed_steps": result["steps"]}
        if f"{v.name}/hybrid_hash=False" in result["ratios"]:
            row["vs_hybrid_hash_false"] = result["ratios"][f"{v.name}/hybrid_hash=False"]
        if v.name in counters:      # the hit ratio while timed: the timed batches repeat every round
            hits, lookups = (b - a for a, b in zip(counters[v.name], _hot_counters(v.model)))
            row["timed_hit_ratio"] = hits / lookups
        out.append(row)
    return out


def run_hotstorage(sizes, progress):
    out = {"title": "Hot-storage size sweep (Table VI)", "rows": [], "notes": [], "batch_size": sizes.hot_batch}
    for exponent in sizes.hot_zipf:
        try:
            out["rows"] += hot_tier_sweep(sizes, exponent, progress)
        except Exception as e:       # noqa: BLE001
            out["rows"].append({"name": f"zipf {exponent}", "zipf": exponent, "error": _error(e)})
        cleanup()
    out["notes"].append(
        f"HybridHash's hot tier (Algorithm 1) on a stream of {sizes.hot_steps} steps of {sizes.hot_batch} x "
        f"{sizes.hot_ids_per_example} Zipf ids over {sizes.hot_vocab:,} (ranks permuted to ids), one table of dim "
        f"{sizes.hot_dim}, Adagrad; warm-up {sizes.hot_warmup} steps, hot set refreshed every {sizes.hot_refresh}. "
        "Hot-tier sizes are shares of the stream's distinct ids. A hit is a step's distinct id that the cache held "
        "when the step began; hit ratios are hits / distinct ids over the steps after the warm-up, the same "
        "stream for every cache: Algorithm 1 as the storage's counters report it; LRU (the ids looked up last, "
        "in stream order); Belady's MIN (clairvoyant: it keeps the ids looked up again soonest; the optimum of "
        "caches that take an id in when a step looks it up); best fixed set (clairvoyant: the ids looked up in "
        "most of those steps, held throughout). samples/s: each model after the stream, timed interleaved on "
        f"{sizes.batches} more batches of the stream, repeated; without a GPU the hot tier is a CPU array, so "
        "both tiers are in DRAM and the column shows the tier's bookkeeping, not a faster memory.")
    return out


def run_deepctr(sizes, progress):
    from picasso_tf.tools.benchmarking import deepctr_models     # it builds on this module
    return deepctr_models.run(sizes, progress)


RUNNERS = {"packing": run_packing, "zoo": run_zoo, "auc": run_auc, "ablation": run_ablation, "ops": run_ops,
           "scaling": run_scaling, "hotstorage": run_hotstorage, "deepctr": run_deepctr}
