"""Where the time of a training step goes: per-op times from a TensorFlow profiler trace.

`op_breakdown(model, dataset, steps)` traces `steps` steps of Keras `fit` (after the
model has been warmed up) with tf.profiler and sums the durations of the kernels it
recorded, read from the trace's XSpace (which names each kernel's node, where the
trace-viewer JSON names only its op type), by op type and by node. Kernels of the
input pipeline (tf.data's threads) count too, their nodes marked "tf.data: "; eager
ops (Python's thread) do not. Times are wall-clock durations of each kernel on its
thread: with inter-op parallelism two kernels may overlap, so the op times can add up
to more than the step; the wall time per step is reported beside them: the median over
the traced steps of each step's own time (from the start to the end of its batch), not
fit's whole duration over the steps: under the profiler fit's teardown (a TensorFlow
handle cleanup after the last step) can take longer than the steps, and would swamp them.

`_trace_events(logdir)` gives the trace-viewer JSON's events, for host events such as
each step's `train_function` span (benchmarks/zoo_slow_cells.py).
"""
import collections
import glob
import json
import os
import shutil
import statistics
import tempfile
import time


def _xspace_path(logdir):
    paths = sorted(glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True))
    if not paths:
        raise RuntimeError(f"no profiler trace was written under {logdir}")
    return paths[-1]


def _trace_events(logdir):
    from tensorflow.python.profiler.internal import _pywrap_profiler   # TF's own converter
    raw, ok = _pywrap_profiler.xspace_to_tools_data([_xspace_path(logdir)], "trace_viewer@", {})
    if not ok:
        raise RuntimeError("the profiler trace could not be converted")
    return json.loads(raw).get("traceEvents", [])


def _op_events(logdir):
    """(node, op type, ms) of every kernel the trace recorded outside Python's own
    thread (eager ops run there)."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2
    space = xplane_pb2.XSpace()
    with open(_xspace_path(logdir), "rb") as f:
        space.ParseFromString(f.read())
    events = []
    for plane in space.planes:
        for line in plane.lines:
            if line.name == "python":
                continue
            where = "" if line.name.startswith("tf_Compute") else "tf.data: "
            for event in line.events:
                meta = plane.event_metadata[event.metadata_id]
                node = meta.name[:-len(meta.display_name) - 1]
                # A kernel is named "node:OpType"; tf.data's iterator spans ("Iterator::Root::...")
                # nest, and are not counted.
                if meta.display_name and meta.name.endswith(":" + meta.display_name) and not node.endswith(":"):
                    events.append((where + node, meta.display_name, event.duration_ps / 1e9))
    return events


def op_breakdown(model, dataset, steps=3, top=25):
    """{"wall_ms_per_step", "op_ms_per_step" (sum), "by_type": [...], "by_node": [...]}."""
    import tensorflow as tf

    class BatchTimer(tf.keras.callbacks.Callback):
        """Each training batch's own time, from its start to its end."""

        def __init__(self):
            super().__init__()
            self._supports_tf_logs = True
            self.seconds = []

        def on_train_batch_begin(self, batch, logs=None):
            self._start = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            self.seconds.append(time.perf_counter() - self._start)

    logdir = tempfile.mkdtemp(prefix="picasso_bench_trace_")
    timer = BatchTimer()
    try:
        tf.profiler.experimental.start(logdir)
        model.fit(dataset, epochs=1, steps_per_epoch=steps, verbose=0, callbacks=[timer])
        tf.profiler.experimental.stop()
        events = _op_events(logdir)
    finally:
        shutil.rmtree(logdir, ignore_errors=True)
    by_type, count_type, by_node = collections.Counter(), collections.Counter(), collections.Counter()
    node_type = {}
    for node, op, ms in events:
        by_type[op] += ms
        count_type[op] += 1
        by_node[node] += ms
        node_type[node] = op
    total = sum(by_type.values())
    return {
        "steps": steps,
        "wall_ms_per_step": 1e3 * statistics.median(timer.seconds),
        "op_ms_per_step": total / steps,
        "by_type": [{"op": op, "ms_per_step": ms / steps, "ops_per_step": count_type[op] / steps,
                     "share": ms / total if total else 0.0} for op, ms in by_type.most_common(top)],
        "by_node": [{"node": node[:160], "op": node_type[node], "ms_per_step": ms / steps,
                     "share": ms / total if total else 0.0} for node, ms in by_node.most_common(top)],
    }
