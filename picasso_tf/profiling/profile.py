"""picasso_tf.profile: the graph before and after rewriting, side by side.

Counts ops of the forward graph and of the whole training step (forward + backward +
optimizer apply) for the original model and the rewritten one, by op type and by
resource class; optionally writes both GraphDefs as .pbtxt, a TensorBoard logdir with
both graphs and a profiler trace of a few training steps, a text table and JSON.
"""
import json
import os

import tensorflow as tf

from picasso_tf.graph.capture import capture, input_signature
from picasso_tf.graph.graph_def_util import prune
from picasso_tf.profiling.op_counts import RESOURCE_CLASSES, count_ops, summarize


def profile(model, batch, out_dir=None, trace_steps=3):
    """Profiles a PicassoModel on one (features, labels) batch (docs/profiling.md).

    Returns a dict: "ops" (op counts of the forward pass and of the training step, the
    plain model's and the rewritten one's, by kind), "step_op_ratio" (rewritten step's
    ops over the plain one's), "embedding_sites", "left_alone" (what the analysis did
    not rewrite, with the reason), "packed_groups", and with out_dir and trace_steps a
    "trace" of that many steps for TensorBoard; format_table(report) prints the counts.
    With out_dir it writes the artefacts listed in the module docstring."""
    x, y = batch[0], batch[1]
    forward = model.rewritten_forward(training=True, example_inputs=x)
    specs = input_signature(model.original, x)
    label_spec = tf.nest.map_structure(lambda t: tf.TensorSpec([None] + list(t.shape[1:]), t.dtype), y)
    graphs = {
        "forward_baseline": capture(model.original, specs, training=True).graph_def,
        "forward_picasso": forward.captured.graph_def,
        "step_baseline": _step_graph(_baseline_step(model), specs, label_spec),
        "step_picasso": _step_graph(_picasso_step(model), specs, label_spec),
    }
    counts = {name: summarize(count_ops(g)) for name, g in graphs.items()}
    training_report = model.picasso.reports.get("training", {})
    report = {
        "ops": counts,
        "step_op_ratio": counts["step_picasso"]["total"] / max(1, counts["step_baseline"]["total"]),
        "embedding_sites": len(training_report.get("analysis", {}).get("sites", [])),
        "left_alone": training_report.get("analysis", {}).get("left_alone", []),
        "packed_groups": len(model.picasso.storages),
    }
    if out_dir:
        _write(out_dir, graphs, report)
        if trace_steps:
            report["trace"] = _trace(model, x, y, os.path.join(out_dir, "tensorboard", "trace"), trace_steps)
    return report


def _loss_fn(model):
    if getattr(model, "compiled_loss", None) is not None:
        return lambda y, p, reg: model.compiled_loss(y, p, regularization_losses=reg)
    bce = tf.keras.losses.BinaryCrossentropy()
    return lambda y, p, reg: bce(y, p) + (tf.add_n(reg) if reg else 0.0)


def _fresh_optimizer(model):
    """A copy of the model's optimizer (Adagrad when uncompiled), so profiling never
    builds slots in, or steps, the user's own optimizer."""
    opt = getattr(model, "optimizer", None)
    if opt is None:
        return tf.keras.optimizers.Adagrad(0.01)
    return type(opt).from_config(opt.get_config())


def _baseline_step(model):
    original, loss_fn, opt = model.original, _loss_fn(model), _fresh_optimizer(model)

    def step(x, y):
        with tf.GradientTape() as tape:
            pred = original(x, training=True)
            loss = loss_fn(y, pred, original.losses)
        variables = original.trainable_variables
        opt.apply_gradients(zip(tape.gradient(loss, variables), variables))
        return loss
    return step


def _picasso_step(model):
    """The model's own training step (forward and TrainingStep) on a copy of its optimizer."""
    loss_fn, opt = _loss_fn(model), _fresh_optimizer(model)
    training_step, _ = model.make_training_step(opt)
    forward = model.rewritten_forward(training=True)

    def step(x, y):
        pred, reg = forward(x)
        loss = loss_fn(y, pred, [reg] if reg is not None else None)
        training_step.run(opt, loss)
        return loss
    return step


def _step_graph(step, specs, label_spec):
    """The step's GraphDef without ops that never run (e.g. placeholders that imports
    mapped to other tensors), as TensorFlow's runtime prunes them too."""
    graph = tf.function(step).get_concrete_function(specs, label_spec).graph
    return prune(graph.as_graph_def(), [t.name for t in graph.outputs],
                 keep=[op.name for op in graph.control_outputs])


def _write(out_dir, graphs, report):
    os.makedirs(out_dir, exist_ok=True)
    for name, graph_def in graphs.items():
        tf.io.write_graph(graph_def, out_dir, f"{name}.pbtxt", as_text=True)
        writer = tf.summary.create_file_writer(os.path.join(out_dir, "tensorboard", name))
        with writer.as_default():
            tf.summary.graph(graph_def)
        writer.close()
    with open(os.path.join(out_dir, "profile.json"), "w") as f:
        json.dump(report, f, indent=1, default=str)
    with open(os.path.join(out_dir, "profile.txt"), "w") as f:
        f.write(format_table(report) + "\n")


def _trace(model, x, y, logdir, steps):
    """A profiler trace of a few rewritten training steps (on a copy of the optimizer);
    the model's weights are restored after."""
    step = tf.function(_picasso_step(model))
    variables = model.original.variables
    saved = [v.read_value() for v in variables]
    step(x, y)                                    # trace outside the profile
    tf.profiler.experimental.start(logdir)
    for _ in range(steps):
        step(x, y)
    tf.profiler.experimental.stop()
    for v, value in zip(variables, saved):
        v.assign(value)
    return logdir


def format_table(report):
    """The op counts as a readable text table."""
    ops = report["ops"]
    cols = ["forward_baseline", "forward_picasso", "step_baseline", "step_picasso"]
    lines = [f"{'':<16}" + "".join(f"{c:>18}" for c in cols)]
    lines.append(f"{'total ops':<16}" + "".join(f"{ops[c]['total']:>18}" for c in cols))
    for cls in RESOURCE_CLASSES:
        lines.append(f"{cls:<16}" + "".join(f"{ops[c]['by_class'][cls]:>18}" for c in cols))
    lines.append(f"training-step ops after/before: {report['step_op_ratio']:.3f}; embedding sites: "
                 f"{report['embedding_sites']}; packed groups: {report['packed_groups']}; "
                 f"left alone: {len(report['left_alone'])}")
    top = sorted(set(ops["step_baseline"]["by_op"]) | set(ops["step_picasso"]["by_op"]),
                 key=lambda op: -(ops["step_baseline"]["by_op"].get(op, 0) + ops["step_picasso"]["by_op"].get(op, 0)))
    lines.append(f"{'op type (step)':<32}{'baseline':>10}{'picasso':>10}")
    for op in top[:25]:
        lines.append(f"{op:<32}{ops['step_baseline']['by_op'].get(op, 0):>10}{ops['step_picasso']['by_op'].get(op, 0):>10}")
    return "\n".join(lines)
