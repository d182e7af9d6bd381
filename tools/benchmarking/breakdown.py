"""Where the time of a training step goes: per-op times from a TensorFlow profiler trace.

`op_breakdown(model, dataset, steps)` traces `steps` steps of Keras `fit` (after the
model has been warmed up) with tf.profiler, converts the trace to the trace-viewer
JSON with TensorFlow's own converter, and sums the durations of the op events
(events marked `is_eager: 0`, i.e. kernels run inside the step's function) by op
type and by node. Times are wall-clock durations of each kernel on its thread: with
inter-op parallelism two kernels may overlap, so the op times can add up to more than
the step; the wall time per step is reported beside them: the median over the traced
steps of each step's own time (from the start to the end of its batch), not fit's
whole duration over the steps: under the profiler fit's teardown (a TensorFlow handle
cleanup after the last step) can take longer than the steps, and would swamp them.
"""
import collections
import glob
import json
import os
import shutil
import statistics
import tempfile
import time


def _trace_events(logdir):
    from tensorflow.python.profiler.internal import _pywrap_profiler   # TF's own converter
    paths = sorted(glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True))
    if not paths:
        raise RuntimeError(f"no profiler trace was written under {logdir}")
    raw, ok = _pywrap_profiler.xspace_to_tools_data([paths[-1]], "trace_viewer@", {})
    if not ok:
        raise RuntimeError("the profiler trace could not be converted")
    data = json.loads(raw)
    frames = {k: v.get("name", "") for k, v in data.get("stackFrames", {}).items()}
    return data.get("traceEvents", []), frames


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
        events, frames = _trace_events(logdir)
    finally:
        shutil.rmtree(logdir, ignore_errors=True)
    by_type, count_type, by_node = collections.Counter(), collections.Counter(), collections.Counter()
    node_type = {}
    for e in events:
        if e.get("ph") != "X" or e.get("args", {}).get("is_eager") != 0:
            continue
        op, dur = e["name"], float(e.get("dur", 0.0)) / 1e3      # ms
        by_type[op] += dur
        count_type[op] += 1
        node = frames.get(str(e.get("sf")), "") or op
        by_node[node] += dur
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
