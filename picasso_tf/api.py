"""The public decorator and the Keras model it returns.

    @picasso_tf.optimize()               # on a function that builds a keras.Model
    def build(): ...
    @picasso_tf.optimize(packing=False)  # on a keras.Model subclass
    class MyModel(tf.keras.Model): ...
    model = picasso_tf.optimize(model)   # on a model instance

The returned PicassoModel is a keras.Model: compile/fit/evaluate/predict, callbacks,
metrics and save_weights/load_weights work as usual. It compiles the model into a
Program (picasso_tf.compile), creates the storage the Program's table layouts name,
and owns train_step: the rewritten graph's forward pass and the staged training step
(picasso_tf.runtime.step). It knows no GraphDef details. Its checkpoints are the plain
model's: the same variables (the tables are read in place) and the Keras optimizer's
slots at the same positions, so either model restores the other's. Under hybrid
parallelism a row-sharded table's original variable holds no rows (each rank's shard
holds its block): save_weights writes the blocks from every rank into one checkpoint
of that format, and get_weights, export and the one-file formats gather the tables.
"""
import contextlib
import dataclasses
import functools
import inspect
import zlib

import tensorflow as tf
from keras.src.engine.base_layer_utils import call_context
from keras.src.engine.training import flatten_metrics_in_order
from keras.src.mixed_precision.autocast_variable import AutoCastVariable
from tensorflow.python.ops.control_flow_util import GraphOrParentsInXlaContext

from picasso_tf.compiler import compile_program
from picasso_tf.distributed.checkpoint import save_sharded_weights
from picasso_tf.config import Config
from picasso_tf.distributed.exchange import RowExchange
from picasso_tf.distributed.reported_ids import InPlaceIdsCheck
from picasso_tf.distributed.world import (World, broadcast_from_rank_zero, check_same_on_every_rank, current_world,
                                          default_malloc_thresholds, oversubscribed_threads,
                                          take_same_number_of_batches)
from picasso_tf.embedding.dynamic_vocabulary import DynamicVocabularyTables
from picasso_tf.embedding.hybrid_hash import HashRowFetch, HybridHashTables, LookedUpIds
from picasso_tf.embedding.lookahead import LookaheadRefresh, PeekedDataset
from picasso_tf.embedding.row_sparse_optimizers import RowSparseOptimizer
from picasso_tf.embedding.sharded import RowShardedTables
from picasso_tf.embedding.storage import make_storage
from picasso_tf.errors import UnsupportedModelError
from picasso_tf.export import export_saved_model
from picasso_tf.graph.capture import check_has_call, input_signature
from picasso_tf.keras_steps import as_written, bound, check_no_activity_losses, check_own_steps, own_keras_steps
from picasso_tf.graph.rebuild import conform_inputs
from picasso_tf.runtime.dense_update import make_dense_update
from picasso_tf.runtime.direct_calls import direct
from picasso_tf.runtime.first_trace import traced_once
from picasso_tf.runtime.fused_update import make_fused_update, refuse_clipping
from picasso_tf.runtime.micro_batch_planner import plan_micro_batches
from picasso_tf.runtime.micro_batches import check_losses, embedding_cut, loss_refusal, run_micro_batches
from picasso_tf.runtime.step import RewrittenForward, TrainingStep
from picasso_tf.runtime.tape import forward_for_tapes, updating_in_gradient


def optimize(target=None, *, example_inputs=None, warmup_data=None, **options):
    """Rewrites a Keras model with PICASSO's passes; returns a PicassoModel, a
    keras.Model that trains like the plain one (docs/getting-started.md).

    Three forms: `optimize(model, **options)`, `@optimize(**options)` on a function
    that builds a model, and on a keras.Model subclass. The options are Config's fields
    (docs/options.md); PICASSO_<OPTION> environment variables win over them. A
    functional model is rewritten here, a subclassed one on its first batch. Refusals
    raise picasso_tf.errors.UnsupportedModelError naming the cause (docs/errors.md).

    example_inputs: a batch of features, needed only for subclassed models whose input
      signature Keras does not know (otherwise the first batch the model sees is used).
    warmup_data: a tf.data.Dataset of (features, label) whose first
      `warmup_batches` batches feed the packing statistics (Eq. 1).
    """
    config = Config.from_options(**options)
    if target is None:
        return functools.partial(optimize, example_inputs=example_inputs, warmup_data=warmup_data, **options)
    if isinstance(target, tf.keras.Model):
        return PicassoModel(target, config, example_inputs=example_inputs, warmup_data=warmup_data)
    if callable(target):
        @functools.wraps(target, updated=())
        def build(*args, **kwargs):
            model = target(*args, **kwargs)
            if not isinstance(model, tf.keras.Model):
                raise TypeError(f"@picasso_tf.optimize: {getattr(target, '__name__', target)} returned "
                                f"{type(model).__name__}, not a keras.Model")
            return PicassoModel(model, config, example_inputs=example_inputs, warmup_data=warmup_data)
        return build
    raise TypeError(f"picasso_tf.optimize takes a keras.Model, a keras.Model subclass or a function "
                    f"building one; got {type(target).__name__}")


# What the training logs add to the model's metrics: the hot tier's hit ratio and rows held
# (HybridHash), the keys held (dynamic vocabularies).
HOT_HIT_RATIO, HOT_TIER_ROWS, VOCABULARY_KEYS = "hot_hit_ratio", "hot_tier_rows", "vocabulary_keys"
STORAGE_LOGS = (HOT_HIT_RATIO, HOT_TIER_ROWS, VOCABULARY_KEYS)

# The storage kinds whose rows a process fetches from its own hash tables each step.
HASHED_IN_PROCESS = (HybridHashTables.kind, DynamicVocabularyTables.kind)


class PicassoInfo:
    """model.picasso: the options (`config`), the compiled Program, the storage, what
    was rewritten (`report()`, docs/how-it-works.md), the tables' write-back and
    read-back for checkpoints (`write_back`, `read_back`, `release`, `export`,
    docs/checkpoints-and-serving.md), the dynamic vocabularies' keys (`vocabulary`),
    and the fused updates for custom loops (`apply_gradients`, `fused_gradients`,
    docs/custom_loops.md)."""

    def __init__(self, config, original=None):
        self.config = config
        self.original = original        # the user's model, which export() saves
        self.program = None             # the compiled Program, once the model is rewritten
        self.storages = {}              # table group name -> EmbeddingStorage
        self.optimizer_note = None      # how the storage is updated, once training starts
        self.updated_in_gradient = []   # storage variables their gradient kernel updates (last trace)
        self.table_variables = []       # every embedding table the analysis recognised, storage ones too
        self.world = World()            # the Horovod ranks it runs on (picasso_tf.distributed)
        self._apply_gradients = self._fused_gradients = None    # the PicassoModel's, once it is made

    @property
    def reports(self):
        return self.program.reports if self.program else {}

    def write_back(self):
        """Makes the original model's tables (and the optimizer's slots of them) hold the
        storage's rows, for checkpoints and export; tables read in place already do.
        Under hybrid parallelism this gathers every rank's shards whole into every rank's
        originals: call it on every rank. They hold the rows until ``release()`` (which
        fit, evaluate, predict and save_weights call) frees them again."""
        for storage in self.storages.values():
            storage.write_back()

    def release(self):
        """Frees the originals' copy of the rows that write_back gathered, where the
        storage holds them itself (each rank's shards of row-sharded tables)."""
        for storage in self.storages.values():
            storage.release()

    def _row_sharded(self):
        return [s for s in self.storages.values() if isinstance(s, RowShardedTables)]

    @contextlib.contextmanager
    def whole_tables(self):
        """The original model's variables hold every row inside (a collective under
        hybrid parallelism, and on return the row-sharded ones are freed again)."""
        self.write_back()
        try:
            yield
        finally:
            self.release()

    def read_back(self):
        """Makes the storage hold the original model's tables again (after they were
        restored or assigned); every rank calls it together. Refused, it changes no storage."""
        for storage in self.storages.values():
            storage.check_read_back()
        for storage in self.storages.values():
            storage.read_back()

    def apply_gradients(self, optimizer, grads_and_vars):
        """Applies a custom loop's gradients (``tape.gradient`` of the model's variables)
        as fit's step does: the tables' row gradients by the fused row-sparse kernels
        (one per table group), the rest by the Keras optimizer (its fused dense update
        where exact). Use it in place of ``optimizer.apply_gradients`` in a
        tf.GradientTape loop; same result, fewer ops (docs/custom_loops.md)."""
        return self._apply_gradients(optimizer, grads_and_vars)

    def fused_gradients(self, optimizer):
        """A block around ``tape.gradient`` in a tf.function custom loop: the fused
        lookups' gradient kernels update their tables with `optimizer` as fit's step
        does (those tables' gradients come back None), and the next
        ``model.picasso.apply_gradients(optimizer, ...)`` applies the rest and
        completes the step. Eagerly it changes nothing (docs/custom_loops.md)."""
        return self._fused_gradients(optimizer)

    def check_optimizer(self, optimizer):
        """Refuses a Keras optimizer that some storage cannot apply, before training
        (the first training step refuses it too). PicassoModel does not override
        compile() to call this: Keras would then skip compiling a model it loads."""
        hashed = [s for s in self.storages.values() if s.kind in HASHED_IN_PROCESS]
        if hashed:
            rows_optimizer = RowSparseOptimizer.from_keras(optimizer, lazy=self.config.lazy_optimizer)
            for storage in hashed:
                storage.check(rows_optimizer)

    def export(self, directory):
        """Writes a SavedModel of the original model with the trained weights, which
        stock TensorFlow loads and serves without picasso_tf (picasso_tf.export)."""
        self.refuse_without_vocabularies("model.picasso.export")
        with self.whole_tables():
            export_saved_model(self.original, directory)

    def refuse_without_vocabularies(self, what):
        """Refuses `what`, which would hold the original model's variables alone, when
        dynamic vocabularies trained tables of their own."""
        dynamic = [s.name for s in self.storages.values() if s.kind == DynamicVocabularyTables.kind]
        if dynamic:
            raise UnsupportedModelError(
                f"picasso_tf: {what} would hold the model's own tables, its untrained hash bins, not the dynamic "
                f"vocabularies trained for groups {dynamic} (keyed by raw id). Use tf.train.Checkpoint or "
                "save_weights in TensorFlow's format (not .h5/.keras), which carry them, and "
                "model.picasso.vocabulary() for the trained keys and rows")

    def vocabulary(self):
        """{logical table name: (keys, rows)} of the dynamic-vocabulary tables (NumPy,
        keys increasing): what they trained, keyed by raw id. Under Horovod each rank
        holds the keys it owns, and this gathers them all, the same on every rank: every
        rank calls it together."""
        return {name: table for s in self.storages.values() if s.kind == DynamicVocabularyTables.kind
                for name, table in s.vocabulary().items()}

    def report(self):
        """A readable summary of what was rewritten."""
        lines = []
        for graph, rep in self.reports.items():
            analysis = rep["analysis"]
            lines.append(f"[{graph} graph] embedding sites: {len(analysis['sites'])}, "
                         f"left as they were: {len(analysis['left_alone'])}")
            for left in analysis["left_alone"]:
                lines.append(f"  left alone: {left['table']}: {left['reason']}")
            if rep.get("common_subexpressions_merged") is not None:
                lines.append(f"  common subexpressions merged: {rep['common_subexpressions_merged']} nodes")
            for p in rep["passes"]:
                detail = {k: v for k, v in p.items() if k not in ("pass", "enabled", "plan", "groups")}
                lines.append(f"  {p['pass']:<13} {'on ' if p['enabled'] else 'off'} {detail if p['enabled'] else ''}")
        if self.optimizer_note:
            lines.append(f"  optimizer: {self.optimizer_note}")
        if self.updated_in_gradient:
            lines.append(f"  updated inside their gradient kernel: {', '.join(self.updated_in_gradient)}")
        for g in self.program.describe_tables() if self.program else ():
            lines.append(f"  packed group {g['group']}: dim {g['dim']}, {len(g['tables'])} tables, "
                         f"{g['rows']} rows, volume {g['param_volume']}")
        return "\n".join(lines)


@tf.keras.utils.register_keras_serializable(package="picasso_tf")
class PicassoModel(tf.keras.Model):
    """A keras.Model running the rewritten graph of `original`. It trains with fit
    (its own fused step), under a tf.GradientTape, or with the original's own
    train_step / compute_loss (docs/custom_loops.md); its checkpoints are the plain
    model's.

    `.keras` files round-trip: model.save("m.keras") (ModelCheckpoint too) and
    tf.keras.models.load_model("m.keras") give a PicassoModel with the same weights and
    optimizer state once picasso_tf is imported; a subclassed original's own classes
    need custom_objects or registration, as for the plain model."""

    def __init__(self, original, config=None, example_inputs=None, warmup_data=None):
        check_has_call(original)
        config = config or Config()
        own_steps = own_keras_steps(original)
        check_own_steps(original, own_steps, config)
        super().__init__(name=f"picasso_{original.name}")
        # Keras casts a subclassed model's float inputs to its compute dtype (float16 under
        # mixed precision); the rewritten graph already casts them where the original did
        # (its trace ran through the original's __call__), as a functional model leaves to its layers.
        self._autocast = False
        self.original = original            # tracked: its variables stay in checkpoints
        self.picasso = PicassoInfo(config, original)
        self.picasso._apply_gradients, self.picasso._fused_gradients = self._apply_gradients, self._fused_gradients
        self._in_gradient = None            # the last fused_gradients block's InGradientUpdates
        self._own_steps = own_steps         # the steps the original overrides, which run bound to this model
        self._warmup_data = warmup_data
        self._forward = None
        self._eager_calls = {}
        self._last_regularization = None
        self._step = None
        self._looked_up_ids = None          # lookahead refresh: a batch's ids per hash-backed table, once made
        if getattr(original, "output_names", None):
            # Keras matches dict labels to outputs by these names.
            self.output_names = list(original.output_names)
        specs = None
        if example_inputs is not None or (getattr(original, "_is_graph_network", False) and original.inputs):
            specs = input_signature(original, example_inputs)
        if specs is not None:
            self._rewrite(specs)
        # Its variables are the original's: built when that is (Keras loads .h5 weights only then).
        self.built = bool(original.built)

    # -- rewriting -------------------------------------------------------------------
    def _rewrite(self, specs):
        world = self.picasso.world = current_world()
        config = self.picasso.config
        if world.distributed and config.hybrid_hash and config.hot_refresh == "lookahead":
            raise UnsupportedModelError(
                f"picasso_tf: hot_refresh='lookahead' refreshes the hot tier from the batches one process reads "
                f"ahead; under Horovod ({world.size} ranks) each rank's hash table serves the others' lookups too. "
                "Use hot_refresh='counts' (Algorithm 1), or train on one process")
        if world.distributed and config.micro_batches == "auto":
            # Each rank would pick K from its own memory and warm-up batch, and the ranks'
            # collectives per micro-batch (the ids check, the row exchange) must pair up.
            raise UnsupportedModelError(
                f"picasso_tf: micro_batches='auto' under Horovod ({world.size} ranks) would let each rank pick its own "
                "number of micro-batches, and every rank must run as many (each exchanges its ids and rows); give "
                "micro_batches a number")
        if world.distributed:
            for advice in (oversubscribed_threads(), default_malloc_thresholds()):
                if advice and world.rank == 0:
                    tf.get_logger().warning(advice)
            with tf.init_scope():
                # Replicas start equal, and shards are cut from rank 0's tables.
                broadcast_from_rank_zero(self.original.variables)
        with as_written(self.original):
            program = compile_program(self.original, self.picasso.config, warmup_data=self._warmup_data, specs=specs)
        check_no_activity_losses(self.original, self._own_steps)
        if world.distributed:
            # The exchange's options shape what each rank sends the others, beyond the graphs.
            exchanged = repr((self.picasso.config.check_ids, self.picasso.config.wire_dtype)).encode()
            check_same_on_every_rank(zlib.crc32(exchanged, program.fingerprint()),
                                     "rewritten graphs or exchange options (check_ids, wire_dtype)")
        storages = {name: make_storage(program.layout(name), world, self.picasso.config, program.initializers)
                    for name in program.storage_refs()}
        self.picasso.program, self.picasso.storages = program, storages
        check_ids = self.picasso.config.check_ids
        kinds = {t.name: t.kind for t in program.tables or ()}
        # Under Horovod a dynamic vocabulary's keys are spread over the ranks too.
        exchanged = [storages[n] for n, k in kinds.items()
                     if k in (RowShardedTables.kind, HybridHashTables.sharded_kind)
                     or (world.distributed and k == DynamicVocabularyTables.kind)]
        hashed = [storages[n] for n, k in kinds.items() if k in HASHED_IN_PROCESS]
        # Under Horovod the ids of tables read in place are checked with the other ranks' in
        # the exchange's ids AllToAllv; a training step without one reports them in its
        # gradients' Allreduce (its Allreduce would wait for a rank whose kernel refused an
        # id). An inference step without one has no collective to leave waiting.
        check_in_place = world.distributed and check_ids
        fetch = {training: RowExchange(exchanged, world, check_ids, training, config.wire_dtype) if exchanged else
                 InPlaceIdsCheck(world) if check_in_place and training else
                 HashRowFetch(hashed, training, check_ids) if hashed else None for training in (True, False)}
        self._forward = {training: RewrittenForward(program.graphs[name], storages, fetch[training],
                                                    check_in_place and isinstance(fetch[training],
                                                                                  (RowExchange, InPlaceIdsCheck)))
                         for training, name in ((True, "training"), (False, "inference"))}
        analysis = program.analyses["training"]
        storage_tables = [v for s in storages.values() for v in s.variables()]
        self.picasso.table_variables = list({v.ref(): v for v in list(analysis.tables.values()) + storage_tables}.values())
        self._densely_read = [v for v in analysis.tables.values() if analysis.densely_read(v)] + [
            v for s in storages.values() if s.layout.densely_read for v in s.variables()]
        self._step = self._looked_up_ids = None

    @traced_once
    def _training_step(self, optimizer=None):
        """Made at the first training step, once the optimizer (the compiled one unless
        given) is known."""
        optimizer = optimizer or self.optimizer
        # Made again after compile() with another optimizer, or after the trainable
        # variables changed (fine-tuning: Keras applies layer.trainable at compile too).
        key = (id(optimizer), tuple(v.ref() for v in self.original.trainable_variables))
        if self._step is None or self._step_key != key:
            self._step, self.picasso.optimizer_note = self.make_training_step(optimizer)
            self._step_key = key
        return self._step

    def _apply_gradients(self, optimizer, grads_and_vars):
        """model.picasso.apply_gradients: see PicassoInfo."""
        if self._forward is None:
            raise ValueError(f"picasso_tf: {self.name} has not run a forward pass yet: compute the gradients "
                             "of a call of it first")
        if self.picasso.world.distributed:
            raise UnsupportedModelError(
                "picasso_tf: model.picasso.apply_gradients under Horovod would apply each rank's own gradients; "
                "train with fit() or train_on_batch(), whose step exchanges them in the hybrid plan")
        step = self._training_step(optimizer)
        gradients = step.split([(g, stored_variable(v)) for g, v in grads_and_vars if g is not None])
        in_gradient, self._in_gradient = self._in_gradient, None
        if in_gradient is not None and in_gradient.ops:
            if in_gradient.iteration is not optimizer.iterations:
                raise ValueError("picasso_tf: model.picasso.apply_gradients got another optimizer than the "
                                 "model.picasso.fused_gradients block before it; give both the same one")
            gradients = dataclasses.replace(gradients, updated_in_gradient=in_gradient.variables,
                                            update_ops=in_gradient.ops)
            self.picasso.updated_in_gradient = [v.name for v in in_gradient.variables]
        step.apply(optimizer, gradients)
        return optimizer.iterations

    @contextlib.contextmanager
    def _fused_gradients(self, optimizer):
        """model.picasso.fused_gradients: see PicassoInfo."""
        if self._forward is None:
            raise ValueError(f"picasso_tf: {self.name} has not run a forward pass yet: call it under the tape first")
        step = self._training_step(optimizer)
        updates = step.in_gradient_updates(optimizer.iterations)
        with updating_in_gradient(updates):
            yield
        self._in_gradient = updates

    def make_training_step(self, optimizer):
        """(TrainingStep for `optimizer`, how it updates the storage): what train_step
        runs, for tools that run or inspect the step themselves (picasso_tf.profile)."""
        storages = list(self.picasso.storages.values())
        if not isinstance(optimizer, tf.keras.optimizers.legacy.Optimizer):   # legacy ones make slots per variable
            with tf.init_scope(), tf.name_scope(getattr(optimizer, "name", None) or "optimizer"):
                # Built on the plain model's variables in its order (and under Keras' names):
                # every slot, the fused updates' too, sits where the plain model's has it.
                optimizer.build(self.original.trainable_variables)
        fused, note = make_fused_update(optimizer, storages, self.picasso.config)
        hashed = [s for s in storages if s.kind in HASHED_IN_PROCESS]
        if hashed and fused is None:
            hybrid = any(s.kind == HybridHashTables.kind for s in hashed)
            option = "hybrid_hash=True" if hybrid else "dynamic_vocabulary"
            raise UnsupportedModelError(f"picasso_tf: {option} needs the fused row-sparse updates, and {note}")
        if any([storage.bind(fused.optimizer) for storage in hashed]):
            # A hot tier made again for the optimizer's slots: what was traced before reads the old one.
            self.predict_function = self.test_function = None
            self._eager_calls, self._looked_up_ids = {}, None
        note = note or (fused and f"packed tables: fused {type(optimizer).__name__}"
                                  f"{' (lazy)' if fused.optimizer.lazy else ''}")
        # The model's own list decides (a trainable=False layer keeps trainable variables);
        # the rewritten graph reads a mixed-precision layer's variable itself, not its
        # float16 view (AutoCastVariable).
        training = {stored_variable(v).ref() for v in self.original.trainable_variables}
        shards = [v for s in storages if s.kind == RowShardedTables.kind and s.layout.trainable for v in s.variables()]
        read = [v for v in self._forward[True].variables if v.ref() in training]
        # A loss of the model's own (compute_loss) may train variables the forward pass does not read.
        read_refs = {v.ref() for v in read}
        unread = [stored_variable(v) for v in self.original.trainable_variables
                  if stored_variable(v).ref() not in read_refs]
        trainable = read + shards + unread
        fetch = self._forward[True].fetch
        fetched_rows = fetch.log.take if fetch is not None else (lambda: [])
        dense_update, dense_note = make_dense_update(optimizer, self.picasso.config)
        # Mixed precision: Keras scales the loss for this optimizer and unscales the gradients.
        loss_scale = optimizer if isinstance(optimizer, tf.keras.mixed_precision.LossScaleOptimizer) else None
        return TrainingStep(trainable, self.picasso.table_variables, fused, self._densely_read,
                            world=self.picasso.world, sharded=shards, fetched_rows=fetched_rows,
                            dense_update=dense_update, loss_scale=loss_scale,
                            ids_check=fetch if isinstance(fetch, InPlaceIdsCheck) else None), \
            "; ".join(filter(None, [note, dense_note]))

    def _ensure_rewritten(self, inputs):
        if self._forward is None:
            self._rewrite(input_signature(self.original, inputs))

    def rewritten_forward(self, training=True, example_inputs=None):
        """The rewritten forward pass (a RewrittenForward: its .captured holds the
        GraphDef); example_inputs rewrite a subclassed model not yet called."""
        if example_inputs is not None:
            self._ensure_rewritten(example_inputs)
        if self._forward is None:
            raise ValueError(f"{self.name} has not been rewritten yet: pass example_inputs or call it on a batch")
        return self._forward[bool(training)]

    # -- keras.Model -------------------------------------------------------------------
    @traced_once
    def call(self, inputs, training=None):
        if not tf.executing_eagerly() and GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()):
            raise UnsupportedModelError(
                f"picasso_tf: {self.name} was called inside an XLA-compiled function (compile(jit_compile=True) or "
                "tf.function(jit_compile=True)); XLA cannot compile picasso_tf's fused embedding kernels. Compile "
                "without jit_compile (the default on CPU), or train without picasso_tf.optimize")
        self._ensure_rewritten(inputs)
        training = bool(training)
        if tf.executing_eagerly():
            if training not in self._eager_calls:
                self._eager_calls[training] = tf.function(
                    lambda x: forward_for_tapes(self._forward[training], x, self.picasso.world, record_on_tapes=False),
                    reduce_retracing=True)
            outputs, self._last_regularization = self._eager_calls[training](inputs)
            return outputs
        outputs, self._last_regularization = forward_for_tapes(self._forward[training], inputs, self.picasso.world)
        return outputs

    @property
    def losses(self):
        """As the plain model's: its regularisation losses, those of the last call
        (computed by the rewritten graph, so a tape differentiates them) once there
        is one here, else the weight regularisers on the model's variables."""
        if self._forward is not None and self._forward[True].captured.regularization_loss is None:
            return []
        last = self._last_regularization
        if last is not None and (tf.executing_eagerly() if not hasattr(last, "graph")
                                 else last.graph is tf.compat.v1.get_default_graph()):
            return [last]
        return [loss for layer in self.original._flatten_layers() for regularizer in layer._callable_losses
                for loss in [regularizer()] if loss is not None]

    # -- a model's own steps (picasso_tf.keras_steps) --------------------------------------
    def _bound_original(self):
        """The original model bound to this one for one of its own steps."""
        def rewritten_call(inputs, training=None, **_):
            # Called through the original's __call__, which resolved the training mode.
            training = training if training is not None else call_context().training
            outputs = self.call(inputs, training)
            if training and self.picasso.storages and self.optimizer is not None:
                refuse_clipping(self.optimizer)     # as fit does: the step applies the tables' gradients
            return outputs
        return bound(self, rewritten_call)

    def test_step(self, data):
        if "test_step" not in self._own_steps:
            return tf.keras.Model.test_step(self, data)
        with self._bound_original() as original:
            return original.test_step(data)

    def predict_step(self, data):
        if "predict_step" not in self._own_steps:
            return tf.keras.Model.predict_step(self, data)
        with self._bound_original() as original:
            return original.predict_step(data)

    def compute_metrics(self, x, y, y_pred, sample_weight):
        if "compute_metrics" not in self._own_steps:
            return tf.keras.Model.compute_metrics(self, x, y, y_pred, sample_weight)
        with self._bound_original() as original:
            return original.compute_metrics(x, y, y_pred, sample_weight)

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None):
        if "compute_loss" in self._own_steps:
            with self._bound_original() as original:
                return original.compute_loss(x, y, y_pred, sample_weight)
        reg = self._last_regularization
        regularization = [reg] if reg is not None and reg.graph is tf.compat.v1.get_default_graph() else None
        return self.compiled_loss(y, y_pred, sample_weight, regularization_losses=regularization)

    @traced_once
    def train_step(self, data):
        if "train_step" in self._own_steps:
            self.picasso.optimizer_note = (f"{type(self.original).__name__}.train_step, the model's own: its "
                                           "optimizer applies the tape's gradients (tables' as tf.IndexedSlices)")
            with self._bound_original() as original:
                return original.train_step(data)
        x, y, sample_weight = tf.keras.utils.unpack_x_y_sample_weight(data)
        self._ensure_rewritten(x)
        fetch = self._forward[True].fetch
        # Under Horovod with no rows exchanged, the step's forward passes report their ids to its Allreduce.
        with fetch.reporting() if isinstance(fetch, InPlaceIdsCheck) else contextlib.nullcontext():
            return self._rewritten_train_step(x, y, sample_weight)

    def _rewritten_train_step(self, x, y, sample_weight):
        """Keras' train_step on the rewritten model: its forward passes, then TrainingStep."""
        k = self.picasso.config.micro_batches
        if k == "auto":
            k = plan_micro_batches(self.picasso.program, self._forward[True], self._warmup_data, x,
                                   loss_refusal(self.compiled_loss), self.picasso.config)
        if k > 1:
            check_losses(self.compiled_loss, k)

            def forward_and_loss(x, y, sample_weight, forward):
                y_pred, self._last_regularization = forward(x)
                return y_pred, self.compute_loss(x, y, y_pred, sample_weight)

            y_pred = run_micro_batches(self._training_step(), self.optimizer, forward_and_loss,
                                       (x, y, sample_weight), k, self._forward[True],
                                       embedding_cut(self._forward[True], self.picasso.program, self.picasso.config),
                                       one_at_a_time=self.picasso.config.micro_batches == "auto"
                                       or isinstance(self._forward[True].fetch, RowExchange))
            return self._metrics_after_checks(x, y, y_pred, sample_weight)
        step = self._training_step()     # first: it binds the storage to the optimizer the forward pass reads
        y_pred = self(x, training=True)
        loss = self.compute_loss(x, y, y_pred, sample_weight)
        updated = step.run(self.optimizer, loss)
        self.picasso.updated_in_gradient = [v.name for v in updated]
        logs = self._metrics_after_checks(x, y, y_pred, sample_weight)
        fetch = self._forward[True].fetch
        hit_ratio = fetch.log.hit_ratio() if fetch is not None else None
        if hit_ratio is not None:
            logs[HOT_HIT_RATIO] = hit_ratio    # the progress bar and TensorBoard show it
            logs[HOT_TIER_ROWS] = tf.add_n([s.hot.held for s in fetch.storages
                                              if s.kind == HybridHashTables.kind and s.hot is not None])
        vocabularies = [s for s in self.picasso.storages.values() if s.kind == DynamicVocabularyTables.kind]
        if vocabularies:
            # Read after the step's updates and evictions: ops on a table run in program order.
            logs[VOCABULARY_KEYS] = tf.add_n([s.keys_held() for s in vocabularies])
        return logs

    def _metrics_after_checks(self, x, y, y_pred, sample_weight):
        """compute_metrics, once the step's ids reported to its Allreduce are found valid
        (under Horovod with no rows exchanged: picasso_tf.distributed.reported_ids)."""
        fetch = self._forward[True].fetch
        with tf.control_dependencies(fetch.checks() if isinstance(fetch, InPlaceIdsCheck) else []):
            return self.compute_metrics(x, y, y_pred, sample_weight)

    # Keras' step functions, called without the dispatch each call pays in proportion to
    # the number of features (picasso_tf.runtime.direct_calls).
    def make_train_function(self, force=False):
        if self.train_function is None or force:
            self.train_function = direct(super().make_train_function(force))
        return self.train_function

    def make_test_function(self, force=False):
        if self.test_function is None or force:
            self.test_function = direct(super().make_test_function(force))
        return self.test_function

    def make_predict_function(self, force=False):
        if self.predict_function is None or force:
            self.predict_function = direct(super().make_predict_function(force))
        return self.predict_function

    def train_on_batch(self, *args, return_dict=False, **kwargs):
        """As keras.Model.train_on_batch: without return_dict, the values of
        metrics_names (a loss alone as a scalar), as for the plain model; the storage's
        figures (hot_hit_ratio, hot_tier_rows, vocabulary_keys) come with return_dict=True,
        and in fit's logs."""
        logs = super().train_on_batch(*args, return_dict=True, **kwargs)
        if return_dict:
            return logs
        return flatten_metrics_in_order({k: v for k, v in logs.items() if k not in STORAGE_LOGS}, self.metrics_names)

    def _trackable_children(self, save_type="checkpoint", **kwargs):
        if save_type != "checkpoint":
            return super()._trackable_children(save_type, **kwargs)
        # The plain model's checkpoint: its layers' variables and the optimizer, at its keys.
        # A tf.train.Checkpoint of the model reads them: storage that holds rows elsewhere
        # and can write them back alone (not a collective across ranks) does so first.
        if tf.executing_eagerly():
            for storage in self.picasso.storages.values():
                if not storage.collective:
                    storage.write_back()
        children = dict(self.original._trackable_children(save_type, **kwargs))
        if self.optimizer is not None:
            children["optimizer"] = self.optimizer
        # State of the storage beyond the rows (a hash table's counts and hot set), under
        # names of its own: the plain model ignores them when it restores.
        for storage in self.picasso.storages.values():
            children.update(storage.checkpoint_children())
        return children

    def get_config(self):
        return {"original": tf.keras.layers.serialize(self.original), "picasso": self.picasso.config.to_dict()}

    @classmethod
    def from_config(cls, config, custom_objects=None):
        original = tf.keras.layers.deserialize(config["original"], custom_objects=custom_objects)
        return cls(original, Config(**config["picasso"]))

    # The original's variables, which are saved, are made to hold the rows first. Under
    # hybrid parallelism that gathers every rank's shards, so every rank calls save, and
    # rank 0 alone writes (the ranks would otherwise write the same files at once).
    def save(self, *args, **kwargs):
        self.picasso.refuse_without_vocabularies("model.save")
        with self.picasso.whole_tables():
            if current_world().rank == 0:
                return super().save(*args, **kwargs)

    def save_weights(self, filepath, overwrite=True, save_format=None, options=None):
        """As keras.Model.save_weights. Under hybrid parallelism every rank calls it; in
        TensorFlow's checkpoint format each rank writes its own rows of the row-sharded
        tables and rank 0 merges them (picasso_tf.distributed.checkpoint), so no rank
        holds a whole table; the one-file formats (.h5) gather the tables first."""
        if not _tensorflow_format(filepath, save_format):
            self.picasso.refuse_without_vocabularies(f"save_weights({str(filepath)!r})")
        world = current_world()
        sharded = self.picasso._row_sharded()
        if world.distributed and sharded and _tensorflow_format(filepath, save_format):
            self.picasso.release()
            for storage in self.picasso.storages.values():
                if storage.kind == DynamicVocabularyTables.kind:
                    storage.write_back()    # gathers every rank's keys, for rank 0's part
            return save_sharded_weights(self, filepath, [b for s in sharded for b in s.held_blocks()], world, options)
        with self.picasso.whole_tables():
            if world.rank == 0:
                return super().save_weights(filepath, overwrite=overwrite, save_format=save_format, options=options)

    def get_weights(self):
        self.picasso.refuse_without_vocabularies("get_weights")
        with self.picasso.whole_tables():
            return super().get_weights()

    def load_weights(self, filepath, *args, **kwargs):
        if not _tensorflow_format(filepath, None):
            self.picasso.refuse_without_vocabularies(f"load_weights({str(filepath)!r})")
        status = super().load_weights(filepath, *args, **kwargs)
        self.picasso.read_back()
        return status

    def set_weights(self, weights):
        super().set_weights(weights)
        self.picasso.read_back()

    # Under hybrid parallelism every rank must run the same number of steps: a rank that
    # stopped early would leave the others waiting in a collective. Given a step count
    # (the same on every rank), Keras stops there; else datasets are cut to the shortest.
    # With hot_refresh="lookahead", Keras reads the dataset through a PeekedDataset and a
    # callback refreshes the hot sets from the batches ahead (picasso_tf.embedding.lookahead).
    def fit(self, x=None, *args, **kwargs):
        self._check_callbacks(inspect.signature(tf.keras.Model.fit).bind(self, x, *args, **kwargs).arguments)
        self.picasso.release()
        x = self._same_length_on_every_rank(x, kwargs.get("steps_per_epoch"))
        config = self.picasso.config
        if not (config.hybrid_hash and config.hot_refresh == "lookahead") or (
                self._forward is not None and not self._hot_sets_to_choose()):
            return super().fit(x, *args, **kwargs)
        if not isinstance(x, tf.data.Dataset):
            raise TypeError(f"picasso_tf: hot_refresh='lookahead' reads fit's input ahead as a tf.data.Dataset; got "
                            f"{type(x).__name__}. Pass tf.data.Dataset.from_tensor_slices((x, y)).batch(batch_size) "
                            "(shuffled as you need), or use hot_refresh='counts'")
        fit = inspect.signature(tf.keras.Model.fit).bind(self, x, *args, **kwargs).arguments
        del fit["self"]
        if fit.get("class_weight"):
            raise ValueError("picasso_tf: hot_refresh='lookahead' reads fit's dataset ahead of Keras, which would map "
                             "class_weight over another dataset than the one read; give the weights as the "
                             "dataset's third element (sample weights), or use hot_refresh='counts'")
        peeked = PeekedDataset(x)
        refresh = LookaheadRefresh(peeked, self._hot_sets_to_choose, self._ids_looked_up,
                                   config.hot_refresh_every, config.lookahead_batches)
        fit["x"], fit["callbacks"] = peeked.dataset, [refresh] + list(fit.get("callbacks") or [])
        return super().fit(**fit)

    def _check_callbacks(self, fit_arguments):
        """Refuses at the start of fit, not epochs in, the callbacks that would save or
        restore the model's own variables alone (dynamic vocabularies are not among them)."""
        for callback in fit_arguments.get("callbacks") or ():
            if isinstance(callback, tf.keras.callbacks.EarlyStopping) and callback.restore_best_weights:
                self.picasso.refuse_without_vocabularies("EarlyStopping(restore_best_weights=True), which copies "
                                                         "get_weights,")
            if isinstance(callback, tf.keras.callbacks.ModelCheckpoint) and (
                    not callback.save_weights_only or not _tensorflow_format(callback.filepath, None)):
                self.picasso.refuse_without_vocabularies(f"ModelCheckpoint({callback.filepath!r})")

    def _hot_sets_to_choose(self, features=None):
        """The hash storages whose hot set a refresh chooses (once the model is rewritten,
        on `features` if it has not been)."""
        if features is not None:
            self._ensure_rewritten(features)
        return [s for s in self.picasso.storages.values()
                if s.kind == HybridHashTables.kind and s.chooses_hot_set]

    def _ids_looked_up(self, features):
        """{table name: distinct ids its lookups read} of a batch's `features`, for the
        hash-backed groups of the rewritten model: the part of its training graph that
        computes the ids (the model's hashing and offsets included), fetching no rows."""
        if self._looked_up_ids is None:
            training = self._forward[True]
            looked_up = LookedUpIds(training.fetch.storages, self.picasso.config.check_ids)
            forward = RewrittenForward(training.captured, self.picasso.storages, looked_up)

            def ids(batch):
                forward.fetch_rows(conform_inputs(forward.captured.input_specs, batch))
                return looked_up.ids
            self._looked_up_ids = tf.function(ids, reduce_retracing=True, autograph=False)
        return self._looked_up_ids(features)

    def evaluate(self, x=None, *args, **kwargs):
        self.picasso.release()
        return super().evaluate(self._same_length_on_every_rank(x, kwargs.get("steps")), *args, **kwargs)

    def predict(self, x, *args, **kwargs):
        self.picasso.release()
        return super().predict(self._same_length_on_every_rank(x, kwargs.get("steps")), *args, **kwargs)

    def _same_length_on_every_rank(self, x, steps):
        world = current_world()
        if not world.distributed or not isinstance(x, tf.data.Dataset) or steps is not None:
            return x
        return take_same_number_of_batches(x, world)


def stored_variable(variable):
    """The variable holding the values of `variable`: itself, or the variable a Keras
    mixed-precision layer reads through an AutoCastVariable."""
    return variable._variable if isinstance(variable, AutoCastVariable) else variable


def _tensorflow_format(filepath, save_format):
    """Whether keras.Model.save_weights writes TensorFlow's checkpoint format."""
    if save_format is not None:
        return save_format.lower().strip() in ("tf", "tensorflow")
    return not str(filepath).endswith((".h5", ".hdf5", ".keras"))
