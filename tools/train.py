"""picasso-train: train a zoo model, plain and/or with picasso_tf.optimize, and compare.

    picasso-train                                   # the embedded default: wide_deep on a small
                                                    # synthetic Criteo, baseline vs picasso
    picasso-train --model din --data movielens
    picasso-train --model dlrm --data day_0.tsv     # a Criteo file (TSV, or CSV with a header)
    picasso-train --model deepfm --data part-*.parquet --schema schema.json
    picasso-train --mode picasso --steps 2000 --checkpoint-every 500 --logdir runs/a
    picasso-train --mode picasso --steps 4000 --logdir runs/a --resume

--mode both (the default) builds the zoo model once, copies its initial weights into a
second copy that picasso_tf.optimize rewrites, trains both on the same data in the
same order (baseline first, then picasso) and prints them side by side: samples/s
(timed between training steps after warm-up, so tracing and the first steps are
excluded), the last epoch's train loss, held-out AUC and log loss, and the training
step's op count before/after (picasso_tf.profile on one batch). The picasso run's
model.picasso.report() follows. Everything printed also goes to a JSON summary.

Data: a synthetic preset (criteo, alibaba, wide; --rows, --vocab-size,
--preset-option), `movielens` (the bundled MovieLens-100K), `synthetic` (generated for
--schema), or files: Criteo TSV/CSV, the generic CSV of picasso_tf.data.write_csv,
Parquet or TFRecord (picasso_tf.data's writers) with --schema. Files are read into
memory (--rows caps how many rows) and split into train and test (--test-fraction).

State: TensorBoard logs, checkpoints (tf.train.CheckpointManager: model, optimizer
state and the step count; a picasso checkpoint is the plain model's) and the summary go
to --logdir (default ./runs/<timestamp>). --resume continues each mode from its latest
checkpoint in --logdir up to the same total (--steps, or --epochs worth of steps); the
data order continues where it stopped. --export DIR writes the trained weights of
the original (un-rewritten) zoo model, model.original.save_weights(DIR/weights), and
a SavedModel of it that stock TensorFlow serves (DIR/saved_model, written by
model.picasso.export), plus DIR/schema.json and DIR/export.json.

Ranks: under `picasso-run -np N` (or horovodrun, mpirun) the same command trains on N
processes: the picasso model with hybrid parallelism (tables sharded over the ranks,
dense layers replicated), the baseline data-parallel with Horovod's
DistributedOptimizer. Each rank trains on its shard of every epoch with --batch-size
examples per step (so N times as many per step in all); samples/s, AUC and log loss
are over all ranks (the test set is split among them and their predictions gathered);
rank 0 prints and writes.

Exit codes: 0 done; 2 bad arguments or data (one line naming the problem and the
valid choices); 3 started by a launcher with more than one process but without a
working Horovod.
"""
import argparse
import datetime
import json
import math
import os
import platform
import sys
import time

from picasso_tf import data as pdata
from picasso_tf.data.errors import first_line
from picasso_tf.data.files import FORMATS
from picasso_tf.distributed.world import horovod_transport, launched_world

EXIT_USAGE = 2
EXIT_MULTIPROCESS = 3
PRESETS = ("criteo", "alibaba", "wide")
DATA_KEYWORDS = PRESETS + ("movielens", "synthetic")
MODES = ("both", "baseline", "picasso")
OPTIMIZERS = ("adam", "adagrad", "sgd", "rmsprop", "ftrl")   # models.training.OPTIMIZERS
DEFAULT_MODEL = "wide_deep"
DEFAULT_DATA = "criteo"
DEFAULT_ROWS = 100_000
DEFAULT_VOCAB = 1000
WARMUP_STEPS = 2          # steps of the first epoch left out of samples/s
# Fields of the run that must not change between a run and its --resume.
RESUME_FIELDS = ("model", "data", "format", "schema", "rows", "vocab_size", "preset_option", "hparam",
                 "test_fraction", "batch_size", "seed", "optimizer", "learning_rate", "picasso_option")


class UsageError(Exception):
    """A problem with the arguments or the data: printed as one line, exit code 2."""


# How a zoo builder or picasso_tf.optimize refuses the options it was given (an option
# not built yet, a value out of range, an unknown keyword): usage errors, not crashes.
REFUSALS = (NotImplementedError, ValueError, TypeError)


# -- multi-process launchers -----------------------------------------------------------------------

class Ranks:
    """The Horovod ranks this run trains on (one process: a world of one, no Horovod)."""

    def __init__(self, size=1, rank=0, transport=None):
        self.size, self.rank, self.transport = size, rank, transport

    @classmethod
    def join(cls, launched_size):
        import horovod.tensorflow as hvd
        hvd.init()
        if hvd.size() != launched_size:
            raise RuntimeError(f"the launcher started {launched_size} processes but Horovod sees {hvd.size()}")
        return cls(hvd.size(), hvd.rank(), horovod_transport())

    @property
    def lead(self):
        """Rank 0: the one that prints and writes."""
        return self.rank == 0

    def broadcast(self, value):
        if self.size == 1:
            return value
        import horovod.tensorflow as hvd
        return hvd.broadcast_object(value, root_rank=0)

    def gather(self, array):
        """Every rank's array, concatenated in rank order."""
        if self.size == 1:
            return array
        import horovod.tensorflow as hvd
        return hvd.allgather(array).numpy()


# -- arguments ---------------------------------------------------------------------------------------

class _Parser(argparse.ArgumentParser):
    """Errors as one line (no usage dump), exit code 2."""

    def error(self, message):
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


# The guide --help points to.
GUIDE = "docs/getting-started.md"


def build_parser():
    p = _Parser(prog="picasso-train", description=__doc__.split("\n\n")[0] + f" Guide: {GUIDE}.",
                formatter_class=argparse.RawDescriptionHelpFormatter,
                epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    g = p.add_argument_group("model and data")
    g.add_argument("--model", default=DEFAULT_MODEL, help=f"a zoo model (default {DEFAULT_MODEL}); see "
                   "picasso_tf.models.list()")
    g.add_argument("--hparam", action="append", default=[], metavar="KEY=VALUE",
                   help="a builder hyper-parameter, VALUE as JSON (e.g. hidden=[128,64]); repeatable")
    g.add_argument("--data", default=DEFAULT_DATA,
                   help=f"a synthetic preset ({', '.join(PRESETS)}), 'movielens', 'synthetic' (with "
                        "--schema), or file(s): a path, directory or glob of Criteo TSV/CSV, CSV, Parquet "
                        f"or TFRecord (default {DEFAULT_DATA})")
    g.add_argument("--schema", help="schema JSON (picasso_tf.data.Schema.save) of the data files; "
                                    "optional for Criteo files")
    g.add_argument("--format", default="auto", choices=FORMATS,
                   help="file format (default: from the extension, else the file's first bytes)")
    g.add_argument("--rows", type=int, help=f"synthetic: rows to generate (default {DEFAULT_ROWS}); files "
                                            "and movielens: read at most this many (default all)")
    g.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB,
                   help=f"ids per categorical feature of synthetic presets and of Criteo files read "
                        f"without --schema (default {DEFAULT_VOCAB})")
    g.add_argument("--preset-option", action="append", default=[], metavar="KEY=VALUE",
                   help="an option of the preset's schema function, e.g. num_fields=50 (wide) or "
                        "seq_len=20 (alibaba); repeatable")
    g.add_argument("--test-fraction", type=float, default=0.2, help="held-out share (default 0.2)")
    g = p.add_argument_group("training")
    g.add_argument("--mode", default="both", choices=MODES,
                   help="baseline (plain zoo model), picasso (picasso_tf.optimize), or both (default)")
    g.add_argument("--batch-size", type=int, help="default: the model's TRAINING recipe")
    g.add_argument("--epochs", type=int, help="default: the model's TRAINING recipe")
    g.add_argument("--steps", type=int, help="total training steps (overrides --epochs)")
    g.add_argument("--optimizer", choices=OPTIMIZERS, help="default: the model's TRAINING recipe")
    g.add_argument("--learning-rate", type=float, help="default: the model's TRAINING recipe")
    g.add_argument("--seed", type=int, default=0, help="data, split, shuffling and initial weights (default 0)")
    g.add_argument("--picasso-option", action="append", default=[], metavar="KEY=VALUE",
                   help="an option of picasso_tf.optimize, e.g. packing=false or micro_batches=2; repeatable")
    g.add_argument("--verbose", type=int, nargs="?", const=1, default=0,
                   help="Keras progress output: --verbose (bar) or --verbose 2 (a line per epoch)")
    g = p.add_argument_group("outputs")
    g.add_argument("--logdir", help="TensorBoard logs, checkpoints, summary (default ./runs/<timestamp>)")
    g.add_argument("--checkpoint-every", type=int, default=0, metavar="N",
                   help="save a checkpoint every N steps (default 0: only at the end of training)")
    g.add_argument("--resume", action="store_true",
                   help="continue from the latest checkpoint in --logdir (each mode its own)")
    g.add_argument("--export", metavar="DIR", help="write the original zoo model's trained weights and a "
                                                   "SavedModel for serving to DIR")
    g.add_argument("--summary", help="JSON summary path (default <logdir>/summary.json)")
    g.add_argument("--no-profile", dest="profile", action="store_false",
                   help="skip the op counts (picasso_tf.profile)")
    g.add_argument("--profile-dir", help="also write picasso_tf.profile's graphs, trace and tables here")
    return p


def _options(items, what):
    """['k=v', ...] -> {k: value}; values parsed as JSON (else kept as strings)."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UsageError(f"{what} {item!r}: expected KEY=VALUE")
        if value.lower() in ("true", "false"):
            value = value.lower()
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def _given(flag, items):
    """" with --flag a=1 b=2" naming the options the user gave, or ""."""
    return f" with {flag} {' '.join(items)}" if items else ""


def _check_numbers(args):
    for name in ("rows", "batch_size", "epochs", "steps", "vocab_size"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.checkpoint_every < 0:
        raise UsageError(f"--checkpoint-every must be >= 0, got {args.checkpoint_every}")
    if not 0 < args.test_fraction < 1:
        raise UsageError(f"--test-fraction must lie strictly between 0 and 1, got {args.test_fraction}")
    if args.learning_rate is not None and args.learning_rate <= 0:
        raise UsageError(f"--learning-rate must be > 0, got {args.learning_rate}")
    if args.resume and not args.logdir:
        raise UsageError("--resume needs --logdir: the directory of the run to continue")


# -- data ------------------------------------------------------------------------------------------

class LoadedData:
    def __init__(self, train, test, description):
        self.train, self.test, self.description = train, test, description

    @property
    def schema(self):
        return self.train.schema


def _read_files(args, schema):
    """(files, TabularData, format, schema source) of the files --data names, read into memory."""
    try:
        files = pdata.data_files(args.data)
    except pdata.DataFileError as e:
        raise UsageError(f"--data {e}; --data takes a preset ({', '.join(DATA_KEYWORDS)}) or files") from None
    source = f"--schema {args.schema}" if args.schema else None
    try:
        fmt = pdata.file_format(files, args.format, schema)
        if schema is None:
            if fmt != "criteo":
                raise UsageError(f"--data {files[0]} is {fmt}: pass --schema schema.json, the schema it was "
                                 "written with (picasso_tf.data.Schema.save)")
            schema = pdata.criteo_schema(args.vocab_size - 1)
            source = f"criteo_schema({args.vocab_size - 1})"
        data = pdata.read_files(files, schema, fmt, rows=args.rows)
    except pdata.DataFileError as e:
        raise UsageError(f"--data {e}") from None
    except pdata.DataFormatError as e:
        hint = "" if args.schema else " (files other than Criteo's need --schema)"
        raise UsageError(f"--data {e}{hint}") from None
    return files, data, fmt, source


def load_data(args):
    """LoadedData (train/test TabularData) for --data."""
    import numpy as np

    try:
        schema = pdata.load_schema(args.schema) if args.schema else None
    except pdata.DataFileError as e:
        raise UsageError(f"--schema {e}") from None
    name = args.data
    if name in PRESETS or name == "synthetic":
        if name == "synthetic":
            if schema is None:
                raise UsageError("--data synthetic generates data for --schema: pass --schema schema.json")
            source = f"schema {args.schema}"
        else:
            if schema is not None:
                raise UsageError(f"--schema applies to data files and 'synthetic', not to the preset {name!r}")
            options = _options(args.preset_option, "--preset-option")
            if name == "criteo":
                options.setdefault("buckets", args.vocab_size - 1)
            else:
                options.setdefault("vocab_size", args.vocab_size)
            try:
                schema = pdata.preset_schema(name, **options)
            except TypeError as e:
                raise UsageError(f"--preset-option for {name!r}: {first_line(e)}") from None
            source = f"preset {name} {options}"
        rows = args.rows or DEFAULT_ROWS
        data = pdata.generate(schema, rows, seed=args.seed)
        train, test = _split(data, args)
        return LoadedData(train, test, f"synthetic {schema.name or name}: {rows} rows ({source})")
    if name == "movielens":
        if schema is not None:
            raise UsageError("--schema applies to data files and 'synthetic', not to movielens")
        train, test = pdata.load_movielens(test_fraction=args.test_fraction, seed=args.seed)
        if args.rows and args.rows < train.num_examples + test.num_examples:
            keep = args.rows / (train.num_examples + test.num_examples)
            rng = np.random.default_rng(args.seed)
            train = train.take(np.sort(rng.permutation(train.num_examples)[:max(2, int(train.num_examples * keep))]))
            test = test.take(np.sort(rng.permutation(test.num_examples)[:max(2, int(test.num_examples * keep))]))
        return LoadedData(train, test, f"MovieLens-100K (bundled): {train.num_examples} train, "
                                       f"{test.num_examples} test ratings, label = rating >= 4")
    if args.preset_option:
        raise UsageError("--preset-option applies to the synthetic presets only")
    files, data, fmt, source = _read_files(args, schema)
    train, test = _split(data, args)
    return LoadedData(train, test, f"{fmt} file{'s' if len(files) > 1 else ''} {name}: {data.num_examples} "
                                   f"rows, schema {source}")


def _split(data, args):
    try:
        return data.split(args.test_fraction, seed=args.seed)
    except ValueError as e:
        raise UsageError(f"--test-fraction: {first_line(e)}") from None


# -- training --------------------------------------------------------------------------------------

def _callback_base():
    import tensorflow as tf
    return tf.keras.callbacks.Callback


def _make_monitor(name, step_var, steps_per_epoch, batch_size, num_examples, manager, checkpoint_every,
                  total_steps, echo, before_save=None):
    """A Keras callback that counts steps, times them, saves checkpoints and (echo) prints a
    line per epoch."""
    class TrainMonitor(_callback_base()):
        def __init__(self):
            super().__init__()
            self.step = int(step_var.numpy())
            self.first_step = self.step
            self.seconds, self.samples, self.timed_steps = 0.0, 0, 0
            self.last_end = None
            self.last_epoch = None
            self.saved = []
            self.epoch_start = None

        def samples_of(self, step):
            position = step % steps_per_epoch
            return batch_size if position < steps_per_epoch - 1 else num_examples - batch_size * (steps_per_epoch - 1)

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch_start = time.perf_counter()
            self.epoch_first_step = self.step

        def on_train_batch_end(self, batch, logs=None):
            now = time.perf_counter()
            step, epoch = self.step, self.step // steps_per_epoch   # the step just done (0-based)
            # Intervals between two steps of one epoch, after the run's first WARMUP_STEPS
            # steps (tracing, pipeline warm-up); my own checkpointing is not counted.
            if self.last_end is not None and self.last_epoch == epoch and step - self.first_step >= WARMUP_STEPS:
                self.seconds += now - self.last_end
                self.samples += self.samples_of(step)
                self.timed_steps += 1
            self.step += 1
            step_var.assign(self.step)
            if manager is not None and checkpoint_every and self.step % checkpoint_every == 0:
                self.save()
            self.last_end, self.last_epoch = time.perf_counter(), epoch

        def save(self):
            if not self.saved or self.saved[-1] != self.step:
                step_var.assign(self.step)
                if before_save is not None:
                    before_save()        # a collective: every rank runs it
                if manager is not None:
                    manager.save(checkpoint_number=self.step)
                self.saved.append(self.step)

        def on_epoch_end(self, epoch, logs=None):
            self.last_end = None
            if echo:
                logs = logs or {}
                shown = "  ".join(f"{k} {v:.4f}" for k, v in logs.items() if isinstance(v, (int, float)))
                print(f"  [{name}] epoch {epoch + 1}: {shown}  ({self.step - self.epoch_first_step} steps, "
                      f"{time.perf_counter() - self.epoch_start:.1f}s, step {self.step}/{total_steps})", flush=True)

        @property
        def samples_per_second(self):
            return self.samples / self.seconds if self.seconds > 0 and self.timed_steps >= 2 else None

    return TrainMonitor()


def _segments(start, total, steps_per_epoch):
    """fit() calls covering steps [start, total): (initial_epoch, epochs, steps_per_epoch,
    first step). Whole epochs go in one call; a partial epoch gets a call of its own."""
    calls, step = [], start
    while step < total:
        epoch = step // steps_per_epoch
        end = min((epoch + 1) * steps_per_epoch, total)
        if step == epoch * steps_per_epoch and end - step == steps_per_epoch and calls \
                and calls[-1][2] == steps_per_epoch and calls[-1][3] + (calls[-1][1] - calls[-1][0]) \
                * steps_per_epoch == step:
            first, _, spe, first_step = calls[-1]
            calls[-1] = (first, epoch + 1, spe, first_step)
        else:
            calls.append((epoch, epoch + 1, end - step, step))
        step = end
    return calls


def _build_training_state(model, dataset):
    """Traces the training step once, without running it, so that every variable training
    creates (optimizer slots, picasso's packed-table slots, metric state) exists before a
    checkpoint is restored into it: restoring into variables made later would be deferred,
    and the slots Keras and picasso_tf create would start from zero. fit() reuses the trace."""
    model.make_train_function().get_concrete_function(iter(dataset))


def _target_dataset(names, data, batch_size, seed, ranks):
    """This rank's endless, per-epoch shuffled (features, targets) batches; targets
    matched to the model's output names."""
    ds = data.dataset(batch_size, shuffle=True, seed=seed, repeat=True, rank=ranks.rank, world=ranks.size)
    if len(names) == 1:
        return ds.map(lambda x, y: (x, y[names[0]] if isinstance(y, dict) else y))
    return ds.map(lambda x, y: (x, {n: y[n] for n in names}))


def _compile(model, recipe, ranks):
    import tensorflow as tf
    from picasso_tf.models.training import OPTIMIZERS as KERAS_OPTIMIZERS, build_optimizer
    optimizer = KERAS_OPTIMIZERS[recipe["optimizer"]](learning_rate=recipe["learning_rate"])
    if ranks.size > 1 and not hasattr(model, "picasso"):
        # The baseline: Horovod's data parallelism (picasso models exchange their own gradients).
        import horovod.tensorflow.keras as hvd_keras
        import horovod.tensorflow as hvd
        hvd.broadcast_variables(model.variables, root_rank=0)
        optimizer = hvd_keras.DistributedOptimizer(optimizer)
    model.compile(optimizer=optimizer, loss="binary_crossentropy", metrics=[tf.keras.metrics.AUC(name="auc")])
    build_optimizer(model)
    if hasattr(model, "picasso"):
        model.picasso.check_optimizer(model.optimizer)
    return model


def train_one(name, model, data, recipe, plan, args, logdir):
    """Trains one model (mode `name`) as `plan` says; returns a dict of results."""
    import tensorflow as tf

    ranks = plan["ranks"]
    bs, total, spe = recipe["batch_size"], plan["total_steps"], plan["steps_per_epoch"]
    picasso = getattr(model, "picasso", None)
    step_var = tf.Variable(0, dtype=tf.int64, trainable=False, name="train_step")
    checkpoint = tf.train.Checkpoint(model=model, optimizer=model.optimizer, step=step_var)
    manager = tf.train.CheckpointManager(checkpoint, os.path.join(logdir, "checkpoints", name), max_to_keep=3)
    resumed_from = None
    if args.resume:
        if manager.latest_checkpoint is None:
            raise UsageError(f"--resume: no {name} checkpoint in {os.path.join(logdir, 'checkpoints', name)}; "
                             f"the run in {logdir} saved none for --mode {name}")
        _build_training_state(model, _target_dataset(plan["outputs"], data.train, bs, args.seed, ranks))
        status = checkpoint.restore(manager.latest_checkpoint)
        try:
            status.assert_consumed()
        except AssertionError as e:
            raise UsageError(f"--resume: {manager.latest_checkpoint} does not fit this {name} model: "
                             f"{first_line(e)}") from None
        if picasso is not None:
            picasso.read_back()
        resumed_from = int(step_var.numpy())
        print(f"  [{name}] resumed from {manager.latest_checkpoint} at step {resumed_from}", flush=True)
    start = int(step_var.numpy())
    monitor = _make_monitor(name, step_var, spe, bs, math.ceil(data.train.num_examples / ranks.size),
                            manager if ranks.lead else None, args.checkpoint_every, total, echo=not args.verbose,
                            before_save=picasso.write_back if picasso is not None else None)
    callbacks = [monitor] + ([tf.keras.callbacks.TensorBoard(os.path.join(logdir, name), write_graph=False,
                                                             profile_batch=0)] if ranks.lead else [])
    history = {}
    began = time.perf_counter()
    if start >= total:
        print(f"  [{name}] already trained to step {start} of {total}: nothing to train", flush=True)
    for initial_epoch, epochs, steps_per_call, first_step in _segments(start, total, spe):
        # A fresh dataset per fit() call: its epochs count from 0 (TabularData.dataset
        # shuffles by (seed, pass over that dataset)), so skipping to the global step
        # gives every step the batch an uninterrupted run would have seen.
        batches = _target_dataset(plan["outputs"], data.train, bs, args.seed, ranks)
        hist = model.fit(batches.skip(first_step) if first_step else batches, epochs=epochs,
                         initial_epoch=initial_epoch, steps_per_epoch=steps_per_call, verbose=args.verbose,
                         callbacks=callbacks)
        for k, v in hist.history.items():
            history.setdefault(k, []).extend(float(x) for x in v)
    train_seconds = time.perf_counter() - began
    if total > start:
        monitor.save()   # the final state, whatever --checkpoint-every
    # Each rank scores an equal share of the test set (its predictions run the same
    # number of steps, as collectives need); the shares are gathered.
    share = data.test.num_examples // ranks.size
    mine = slice(ranks.rank * share, (ranks.rank + 1) * share)
    scores = {k: ranks.gather(v) for k, v in _predict(
        model, {k: v[mine] for k, v in data.test.features.items()}, plan["outputs"]).items()}
    labels = {k: ranks.gather(v[mine]) for k, v in data.test.label_dict.items()}
    test = {}
    for label, p in scores.items():
        if label in labels:
            test[label] = {"auc": _auc(labels[label], p), "log_loss": _log_loss(labels[label], p)}
    first = next(iter(test.values()), {"auc": None, "log_loss": None})
    if ranks.lead:
        writer = tf.summary.create_file_writer(os.path.join(logdir, name, "eval"))
        with writer.as_default():
            for label, values in test.items():
                for metric, value in values.items():
                    if value is not None:
                        tf.summary.scalar(f"test_{metric}" + (f"_{label}" if len(test) > 1 else ""), value,
                                          step=monitor.step)
        writer.close()
    per_rank = monitor.samples_per_second
    return {
        "samples_per_second": per_rank * ranks.size if per_rank else None,
        "timed_steps": monitor.timed_steps,
        "train_loss": history.get("loss", [None])[-1],
        "test_auc": first["auc"],
        "test_log_loss": first["log_loss"],
        "test": test,
        "history": history,
        "steps": monitor.step,
        "steps_this_run": monitor.step - start,
        "resumed_from_step": resumed_from,
        "train_seconds": train_seconds,
        "checkpoints": list(monitor.saved),
        "latest_checkpoint": manager.latest_checkpoint,
    }


def _predict(model, features, names, batch_size=4096):
    """{output name: probabilities [N]}."""
    import numpy as np
    out = model.predict(dict(features), batch_size=batch_size, verbose=0)
    if not isinstance(out, dict):
        out = {names[0]: out} if len(names) == 1 else dict(zip(names, out))
    return {k: np.asarray(v).reshape(-1) for k, v in out.items()}


def _auc(labels, scores):
    from picasso_tf.models.training import auc
    value = auc(labels, scores)
    return None if math.isnan(value) else value


def _log_loss(labels, scores):
    import numpy as np
    p = np.clip(np.asarray(scores, np.float64), 1e-7, 1 - 1e-7)
    y = np.asarray(labels, np.float64)
    return float(-np.mean(y * np.log(p) + (1 - y) * np.log(1 - p)))


# -- the run ---------------------------------------------------------------------------------------

def _machine():
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    import tensorflow as tf
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
            "tensorflow": tf.__version__, "platform": platform.platform()}


def _resolve_logdir(args):
    if args.logdir:
        return args.logdir
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return os.path.join("runs", stamp)


def _check_resume(args, logdir, run_config):
    path = os.path.join(logdir, "run_config.json")
    if not os.path.exists(path):
        raise UsageError(f"--resume: {logdir} holds no run_config.json; it is not a picasso-train logdir")
    with open(path) as f:
        saved = json.load(f)
    for key in RESUME_FIELDS:
        if saved.get(key) != run_config.get(key):
            raise UsageError(f"--resume: --{key.replace('_', '-')} is {run_config.get(key)!r} here but "
                             f"{saved.get(key)!r} in the checkpointed run; resume with the same setting")


def _clean(value):
    """JSON-safe: NaN/inf -> None, numpy scalars -> Python."""
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):
        try:
            value = value.item()
        except (ValueError, AttributeError):
            return str(value)
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


def _fmt(value, spec):
    return "n/a" if value is None else format(value, spec)


def format_comparison(results, ops):
    """The side-by-side table of the modes that ran."""
    modes = [m for m in ("baseline", "picasso") if m in results]
    rows = [("samples/s (after warm-up)", "samples_per_second", ",.0f"),
            ("train loss (last epoch)", "train_loss", ".4f"),
            ("test AUC", "test_auc", ".4f"),
            ("test log loss", "test_log_loss", ".4f"),
            ("training steps", "steps", "d"),
            ("train seconds (incl. tracing)", "train_seconds", ".1f")]
    lines = [f"{'':<32}" + "".join(f"{m:>14}" for m in modes) + ("      picasso/baseline" if len(modes) == 2 else "")]
    for label, key, spec in rows:
        line = f"{label:<32}" + "".join(f"{_fmt(results[m][key], spec):>14}" for m in modes)
        if len(modes) == 2 and key == "samples_per_second" and results["baseline"][key] and results["picasso"][key]:
            line += f"      x{results['picasso'][key] / results['baseline'][key]:.2f}"
        lines.append(line)
    if ops:
        counts = {"baseline": ops["step_baseline"], "picasso": ops["step_picasso"]}
        forward = {"baseline": ops["forward_baseline"], "picasso": ops["forward_picasso"]}
        shown = modes if len(modes) == 2 else ["baseline", "picasso"]
        if len(modes) == 1:   # profile always sees both graphs
            lines[0] = f"{'':<32}" + "".join(f"{m:>14}" for m in shown)
        lines.append(f"{'training-step ops':<32}" + "".join(f"{counts[m]:>14,}" for m in shown)
                     + f"      x{counts['picasso'] / max(1, counts['baseline']):.3f}")
        lines.append(f"{'forward ops':<32}" + "".join(f"{forward[m]:>14,}" for m in shown)
                     + f"      x{forward['picasso'] / max(1, forward['baseline']):.3f}")
    return "\n".join(lines)


def run(args):
    """Runs picasso-train with parsed arguments; returns a dict: "summary" (what was
    printed and saved) and "models" ({mode: trained keras.Model}). Raises UsageError."""
    _check_numbers(args)
    import numpy as np
    import tensorflow as tf
    import picasso_tf
    from picasso_tf import models as zoo
    from picasso_tf.models.training import output_names, recipe as zoo_recipe

    if args.model not in zoo.list():
        raise UsageError(f"--model {args.model!r} is not in the zoo; choose one of: {', '.join(zoo.list())}")
    hparams = _options(args.hparam, "--hparam")
    picasso_options = _options(args.picasso_option, "--picasso-option")
    try:
        picasso_tf.Config.from_options(**picasso_options)
    except REFUSALS as e:
        raise UsageError(f"--picasso-option: {first_line(e)}") from None
    recipe = zoo_recipe(args.model, optimizer=args.optimizer, learning_rate=args.learning_rate,
                        batch_size=args.batch_size, epochs=args.epochs)

    started = time.perf_counter()
    data = load_data(args)
    schema = data.schema
    missing = zoo.missing_inputs(args.model, schema)
    if missing:
        fits = zoo.compatible(schema)
        raise UsageError(f"--model {args.model} needs inputs the data ({schema.name or args.data}) lacks: "
                         f"{'; '.join(missing)}. Models that fit this data: {', '.join(fits) or 'none'}")

    ranks = getattr(args, "_ranks", None) or Ranks()
    bs = int(recipe["batch_size"])
    steps_per_epoch = math.ceil(data.train.num_examples / (bs * ranks.size))
    total_steps = args.steps or int(recipe["epochs"]) * steps_per_epoch
    plan = {"steps_per_epoch": steps_per_epoch, "total_steps": total_steps, "ranks": ranks}

    logdir = ranks.broadcast(_resolve_logdir(args))
    run_config = {k: getattr(args, k) for k in ("model", "data", "format", "schema", "rows", "vocab_size",
                                                 "preset_option", "hparam", "test_fraction", "seed",
                                                 "picasso_option")}
    run_config.update(batch_size=bs, optimizer=recipe["optimizer"], learning_rate=recipe["learning_rate"])
    if args.resume:
        _check_resume(args, logdir, run_config)
    if ranks.lead:
        os.makedirs(logdir, exist_ok=True)
        with open(os.path.join(logdir, "run_config.json"), "w") as f:
            json.dump(_clean(run_config), f, indent=1)

    print(f"picasso-train: {args.model} on {data.description}", flush=True)
    print(f"  train {data.train.num_examples} / test {data.test.num_examples} examples; "
          f"{recipe['optimizer']} lr {recipe['learning_rate']}, batch {bs}, {total_steps} steps "
          f"({total_steps / steps_per_epoch:.2g} epochs); mode {args.mode}; logdir {logdir}"
          + (f"; {ranks.size} ranks over {ranks.transport}, batch {bs} each" if ranks.size > 1 else ""),
          flush=True)

    # Models: built once (seeded); the picasso copy starts from the same weights.
    meta = zoo.info(args.model)
    tf.keras.utils.set_random_seed(args.seed)
    params = dict(meta.prepare(schema, data.train.features)) if meta.prepare else {}
    params.update(hparams)
    try:
        reference = meta.builder(schema, **params)
    except REFUSALS as e:
        raise UsageError(f"--model {args.model}{_given('--hparam', args.hparam)} cannot be built: "
                         f"{first_line(e)}") from None
    plan["outputs"] = output_names(reference)
    unlabeled = [n for n in plan["outputs"] if n not in schema.labels]
    if unlabeled:
        raise UsageError(f"--model {args.model} outputs {unlabeled}, which the data has no labels for "
                         f"(labels: {schema.labels})")
    modes = ["baseline", "picasso"] if args.mode == "both" else [args.mode]
    models = {}
    if "baseline" in modes:
        models["baseline"] = reference
    if "picasso" in modes:
        original = reference
        if "baseline" in modes:
            original = meta.builder(schema, **params)
            original.set_weights(reference.get_weights())
            same = all(np.array_equal(a, b) for a, b in zip(original.get_weights(), reference.get_weights()))
            if not same or len(original.weights) != len(reference.weights):
                raise RuntimeError("the picasso copy of the model did not get the baseline's initial weights")
        t = time.perf_counter()
        try:
            models["picasso"] = picasso_tf.optimize(
                original, warmup_data=data.train.dataset(bs, shuffle=True, seed=args.seed, rank=ranks.rank,
                                                         world=ranks.size), **picasso_options)
        except REFUSALS as e:
            raise UsageError(f"picasso_tf.optimize refused --model {args.model}"
                             f"{_given('--picasso-option', args.picasso_option)}: {first_line(e)}") from None
        print(f"  [picasso] graph rewritten in {time.perf_counter() - t:.1f}s", flush=True)
    for name, model in models.items():
        try:
            _compile(model, recipe, ranks)
        except REFUSALS as e:
            raise UsageError(f"the {name} model refused --optimizer {recipe['optimizer']}: {first_line(e)}") from None

    results = {}
    for mode in modes:
        print(f"training {mode} ...", flush=True)
        results[mode] = train_one(mode, models[mode], data, recipe, plan, args, logdir)

    profile = None
    ops = None
    if "picasso" in models and args.profile:
        t = time.perf_counter()
        batch = next(iter(_target_dataset(plan["outputs"], data.train, bs, args.seed, ranks)))
        profile = picasso_tf.profile(models["picasso"], batch, out_dir=args.profile_dir if ranks.lead else None,
                                     trace_steps=3 if args.profile_dir else 0)
        ops = {k: v["total"] for k, v in profile["ops"].items()}
        from picasso_tf.profiling.profile import format_table
        if ranks.lead:
            with open(os.path.join(logdir, "profile.txt"), "w") as f:
                f.write(format_table(profile) + "\n")
        print(f"  op counts from picasso_tf.profile on one batch ({time.perf_counter() - t:.1f}s)", flush=True)

    table = format_comparison(results, ops)
    print()
    print(table)
    report = None
    if "picasso" in models:
        report = models["picasso"].picasso.report()
        print()
        print("model.picasso.report():")
        print(report)

    export = None
    if args.export and "picasso" in models:
        models["picasso"].picasso.write_back()      # gathers the shards: every rank takes part
    if args.export and ranks.lead:
        export = export_original(models["picasso"] if "picasso" in models else models["baseline"], args, schema,
                                 params, "picasso" if "picasso" in models else "baseline")
        print(f"\nexported the trained weights into the original {args.model}: {export['weights']}; "
              f"a SavedModel of it for serving: {export['saved_model']}")

    summary = {
        "command": "picasso-train " + " ".join(sys.argv[1:] if getattr(args, "_argv", None) is None
                                               else args._argv),
        "model": args.model, "data": data.description, "schema": schema.name, "mode": args.mode,
        "recipe": recipe, "hparams": {k: v for k, v in params.items() if k in hparams},
        "picasso_options": picasso_options,
        "train_examples": data.train.num_examples, "test_examples": data.test.num_examples,
        "steps_per_epoch": steps_per_epoch, "total_steps": total_steps,
        "results": results, "op_counts": ops,
        "step_op_ratio": profile["step_op_ratio"] if profile else None,
        "speedup": (results["picasso"]["samples_per_second"] / results["baseline"]["samples_per_second"]
                    if len(results) == 2 and results["picasso"]["samples_per_second"]
                    and results["baseline"]["samples_per_second"] else None),
        "table": table, "picasso_report": report, "export": export, "logdir": logdir,
        "machine": _machine(), "wall_seconds": time.perf_counter() - started,
    }
    summary["ranks"], summary["transport"] = ranks.size, ranks.transport
    summary_path = args.summary or os.path.join(logdir, "summary.json")
    if ranks.lead:
        os.makedirs(os.path.dirname(os.path.abspath(summary_path)), exist_ok=True)
        with open(summary_path, "w") as f:
            json.dump(_clean(summary), f, indent=1)
    print(f"\nsummary: {summary_path}   tensorboard --logdir {logdir}")
    return {"summary": summary, "models": models, "data": data, "logdir": logdir}


def export_original(model, args, schema, params, mode):
    """Writes `model`'s trained weights as weights of the original zoo model to args.export."""
    out = args.export
    os.makedirs(out, exist_ok=True)
    from picasso_tf.export import export_saved_model
    saved_model = os.path.join(out, "saved_model")
    if mode == "picasso":
        model = model.original                  # the caller wrote the storage back into it
        export_saved_model(model, saved_model)
    else:
        export_saved_model(model, saved_model)
    weights = os.path.join(out, "weights")
    model.save_weights(weights)
    schema.save(os.path.join(out, "schema.json"))
    plain = {k: v for k, v in params.items() if _is_json(v)}
    info = {"model": args.model, "hparams": plain, "trained_with": mode, "weights": weights,
            "saved_model": saved_model,
            "hparams_left_out": sorted(set(params) - set(plain)),
            "load": "import picasso_tf.models as zoo; from picasso_tf.data import Schema; "
                    "m = zoo.get(MODEL)(Schema.load('schema.json'), **HPARAMS); m.load_weights('weights')"}
    with open(os.path.join(out, "export.json"), "w") as f:
        json.dump(info, f, indent=1)
    return info


def _is_json(value):
    try:
        json.dumps(value)
        return True
    except TypeError:
        return False


def main(argv=None):
    """The console script picasso-train; returns the exit code."""
    size, rank = launched_world()
    ranks = Ranks()
    if size > 1:
        try:
            ranks = Ranks.join(size)
        except Exception as e:  # noqa: BLE001  (no horovod, or it cannot start: said in one line)
            # Every rank says it: a launcher may stop the job as soon as one rank exits.
            print(f"picasso-train: started as {size} processes (this is rank {rank}), but Horovod cannot "
                  f"join them: {first_line(e)}. Start it with picasso-run -np {size} (scripts/setup_env.sh "
                  "builds Horovod), or as one process; nothing was trained.", file=sys.stderr, flush=True)
            return EXIT_MULTIPROCESS
        if not ranks.lead:
            sys.stdout = open(os.devnull, "w")     # rank 0 prints
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:          # --help, or a bad argument (already printed)
        return e.code
    args._argv = None if argv is None else list(argv)
    args._ranks = ranks
    try:
        run(args)
    except UsageError as e:
        print(f"picasso-train: error: {e}", file=sys.stderr, flush=True)
        return EXIT_USAGE
    return 0


if __name__ == "__main__":
    sys.exit(main())
