"""The public decorator and the Keras model it returns.

    @picasso_tf.optimize()               # on a function that builds a keras.Model
    def build(): ...
    @picasso_tf.optimize(packing=False)  # on a keras.Model subclass
    class MyModel(tf.keras.Model): ...
    model = picasso_tf.optimize(model)   # on a model instance

The returned PicassoModel is a keras.Model: compile/fit/evaluate/predict, callbacks,
metrics and save_weights/load_weights work as usual. It owns train_step: the rewritten
graph's forward pass, tf.gradients, dense variables through the user's optimizer and
packed tables through the row-sparse path.
"""
import functools

import tensorflow as tf

from picasso_tf.config import Config
from picasso_tf.graph.analysis import find_embedding_sites
from picasso_tf.graph.capture import capture, input_signature
from picasso_tf.passes.manager import run_passes
from picasso_tf.passes.plan import RewritePlan
from picasso_tf.passes.statistics import static_accesses, warmup_statistics
from picasso_tf.runtime.fused_update import make_fused_update
from picasso_tf.runtime.step import GradientApplier, RewrittenForward


def optimize(target=None, *, example_inputs=None, warmup_data=None, **options):
    """Rewrites a Keras model with PICASSO's passes. See Config for the options.

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


class PicassoInfo:
    """model.picasso: the options, the plan, the report, and weight write-back."""

    def __init__(self, config):
        self.config = config
        self.plan = RewritePlan()
        self.reports = {}
        self.optimizer_note = None      # how packed tables are updated, once training starts
        self.updated_in_gradient = []   # packed tables their gradient kernel updates (last trace)
        self.table_variables = []       # every embedding table the analysis recognised, packed ones too

    @property
    def packed_tables(self):
        return list(self.plan.packed_tables.values())

    def write_back(self):
        """Copies packed rows back into the original model's tables (for serving/export)."""
        for table in self.packed_tables:
            table.write_back()

    def report(self):
        """A readable summary of what was rewritten."""
        lines = []
        for graph, rep in self.reports.items():
            analysis = rep["analysis"]
            lines.append(f"[{graph} graph] embedding sites: {len(analysis['sites'])}, "
                         f"left as they were: {len(analysis['left_alone'])}")
            for left in analysis["left_alone"]:
                lines.append(f"  left alone: {left['table']}: {left['reason']}")
            for p in rep["passes"]:
                detail = {k: v for k, v in p.items() if k not in ("pass", "enabled", "plan", "groups")}
                lines.append(f"  {p['pass']:<13} {'on ' if p['enabled'] else 'off'} {detail if p['enabled'] else ''}")
        if self.optimizer_note:
            lines.append(f"  optimizer: {self.optimizer_note}")
        if self.updated_in_gradient:
            lines.append(f"  updated inside their gradient kernel: {', '.join(self.updated_in_gradient)}")
        for g in self.plan.describe():
            lines.append(f"  packed group {g['group']}: dim {g['dim']}, {len(g['tables'])} tables, "
                         f"{g['rows']} rows, volume {g['param_volume']}")
        return "\n".join(lines)


class PicassoModel(tf.keras.Model):
    """A keras.Model running the rewritten graph of `original`."""

    def __init__(self, original, config=None, example_inputs=None, warmup_data=None):
        super().__init__(name=f"picasso_{original.name}")
        self.original = original            # tracked: its variables stay in checkpoints
        self.picasso = PicassoInfo(config or Config())
        self._warmup_data = warmup_data
        self._forward = None
        self._eager_calls = {}
        self._last_regularization = None
        self._applier = None
        if getattr(original, "output_names", None):
            # Keras matches dict labels to outputs by these names.
            self.output_names = list(original.output_names)
        specs = None
        if example_inputs is not None or (getattr(original, "_is_graph_network", False) and original.inputs):
            specs = input_signature(original, example_inputs)
        if specs is not None:
            self._rewrite(specs)

    # -- rewriting -------------------------------------------------------------------
    def _rewrite(self, specs):
        cfg, plan = self.picasso.config, self.picasso.plan
        train = capture(self.original, specs, training=True)
        infer = capture(self.original, specs, training=False)
        analysis = find_embedding_sites(train)
        if self._warmup_data is not None and cfg.warmup_batches:
            plan.accesses, plan.distinct_ids = warmup_statistics(train, analysis, self._warmup_data,
                                                                 cfg.warmup_batches)
            plan.statistics_source = f"{cfg.warmup_batches} warm-up batches"
        else:
            plan.accesses = static_accesses(train, analysis)
        train, self.picasso.reports["training"] = run_passes(train, plan, cfg)
        infer, self.picasso.reports["inference"] = run_passes(infer, plan, cfg)
        self._forward = {True: RewrittenForward(train), False: RewrittenForward(infer)}
        # Attribute assignment makes Keras track the new variables (checkpoints, weights).
        self.packed_tables = [t.variable for t in self.picasso.packed_tables]
        self.picasso.table_variables = list(analysis.tables.values()) + self.packed_tables
        self._densely_read = [v for v in analysis.tables.values() if analysis.densely_read(v)] + [
            t.variable for t in self.picasso.packed_tables if t.group.densely_read]
        self._applier = None

    def _gradient_applier(self):
        """Made at the first training step, once the optimizer is known."""
        if self._applier is None:
            fused, note = make_fused_update(self.optimizer, self.picasso.packed_tables, self.picasso.config)
            self.picasso.optimizer_note = note or (fused and f"packed tables: fused {type(self.optimizer).__name__}"
                                                   f"{' (lazy)' if fused.optimizer.lazy else ''}")
            # Attribute assignment tracks the slot variables, so checkpoints hold them.
            self.packed_table_slots = fused.slots if fused else {}
            trainable = [v for v in self._forward[True].variables if v.trainable]
            self._applier = GradientApplier(trainable, self.picasso.table_variables, fused, self._densely_read)
        return self._applier

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
    def call(self, inputs, training=None):
        self._ensure_rewritten(inputs)
        training = bool(training)
        if tf.executing_eagerly():
            if training not in self._eager_calls:
                self._eager_calls[training] = tf.function(lambda x: self._forward[training](x)[0],
                                                          reduce_retracing=True)
            return self._eager_calls[training](inputs)
        outputs, self._last_regularization = self._forward[training](inputs)
        return outputs

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None):
        reg = self._last_regularization
        regularization = [reg] if reg is not None and reg.graph is tf.compat.v1.get_default_graph() else None
        return self.compiled_loss(y, y_pred, sample_weight, regularization_losses=regularization)

    def train_step(self, data):
        x, y, sample_weight = tf.keras.utils.unpack_x_y_sample_weight(data)
        self._ensure_rewritten(x)
        y_pred = self(x, training=True)
        loss = self.compute_loss(x, y, y_pred, sample_weight)
        updated = self._gradient_applier().apply(self.optimizer, loss)
        self.picasso.updated_in_gradient = [v.name for v in updated]
        return self.compute_metrics(x, y, y_pred, sample_weight)

    def save_weights(self, filepath, *args, **kwargs):
        # Keep the original tables current too, so the checkpoint serves either model.
        self.picasso.write_back()
        return super().save_weights(filepath, *args, **kwargs)

    def get_config(self):
        return {"original": tf.keras.layers.serialize(self.original), "picasso": self.picasso.config.to_dict()}
