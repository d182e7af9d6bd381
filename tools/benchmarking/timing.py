"""Interleaved throughput measurement for the benchmark suite (picasso-bench).

Every variant of one comparison (baseline Keras model, the same model through
picasso_tf.optimize, a dense-only bound, ...) is a compiled keras.Model with an
in-memory dataset of pre-built batches. `measure` warms each one up (tracing and the
first steps happen there), then runs `rounds` rounds; in every round each variant
trains `steps` steps with Keras' own `fit`, the variants taking turns (ABAB..., the
starting variant rotating from round to round) so that a change of machine load hits
them all alike. With `min_window_s`, each variant trains enough steps per round to fill a
window of at least that many seconds (counted from the fastest step of a probe after its
warm-up): a median over a few milliseconds means nothing on a shared machine. A step's
time is the interval between two consecutive `on_train_batch_end` callbacks, so fit's
set-up and the first batch's iterator start are left out. Per round and variant the median step time gives samples/s; the result
holds the median over rounds, the spread (min and max over rounds), and per pair the
ratio taken round by round (both figures of a ratio come from the same round).
"""
import dataclasses
import os
import statistics
import time
from typing import Callable, Dict, List, Optional

import tensorflow as tf

from picasso_tf.data.pipeline import without_autotuner


class StepTimer(tf.keras.callbacks.Callback):
    """Records the wall-clock time at the end of every training batch."""

    def __init__(self):
        super().__init__()
        self._supports_tf_logs = True     # no conversion of the logs to numpy per batch
        self.times = []

    def on_train_batch_end(self, batch, logs=None):
        self.times.append(time.perf_counter())


@dataclasses.dataclass
class Variant:
    """One model to time: compiled, with its dataset (pre-built batches, repeated)."""
    name: str
    model: tf.keras.Model
    dataset: tf.data.Dataset
    batch_size: int


def in_memory_dataset(batches):
    """A repeating, prefetched tf.data.Dataset over pre-built (features, labels)
    batches held as tensors: each element is a stored batch, nothing is sliced,
    copied or parsed per step, so the reader never limits the step rate. tf.data's
    autotuner is off, as in picasso_tf's readers: with it, a fit call can end long
    after its last step (pipeline.without_autotuner)."""
    datasets = [tf.data.Dataset.from_tensors(b) for b in batches]
    ds = datasets[0]
    for other in datasets[1:]:
        ds = ds.concatenate(other)
    return without_autotuner(ds.repeat().prefetch(2))


def step_times(model, dataset, steps):
    """Trains `steps` steps with model.fit; returns the steps - 1 step intervals (s)."""
    timer = StepTimer()
    model.fit(dataset, epochs=1, steps_per_epoch=steps, verbose=0, callbacks=[timer])
    t = timer.times
    return [b - a for a, b in zip(t, t[1:])]


def summary_lines(result):
    """measure()'s result as lines of text: each variant's samples/s (median, min-max over
    the rounds) and window per round, then each ratio (median, min-max)."""
    lines = [f"{name:18} {v['samples_per_s']:>10,.0f} samples/s ({v['samples_per_s_min']:,.0f}-"
             f"{v['samples_per_s_max']:,.0f}), window {v['window_s']:.1f} s"
             for name, v in result["variants"].items()]
    return lines + [f"{pair:34} {r['median']:.2f}x ({r['min']:.2f}-{r['max']:.2f})"
                    for pair, r in result["ratios"].items()]


def load_average():
    try:
        return list(os.getloadavg())
    except OSError:
        return None


def measure(variants: List[Variant], rounds: int, steps: int, warmup_steps: int = 2,
            pairs=(), progress: Optional[Callable[[str], None]] = None, min_window_s: float = 0.0) -> Dict:
    """Times the variants interleaved (see the module docstring).

    pairs: (numerator, denominator) variant names whose throughput ratio is wanted,
      e.g. ("picasso", "baseline"): the ratio is computed per round, then its median
      and spread are reported.
    Returns {"variants": {name: {...}}, "ratios": {"a/b": {...}}, "rounds", "steps",
    "load_average": [before, after]}.
    """
    say = progress or (lambda _msg: None)
    steps = max(2, int(steps))
    load_before = load_average()
    warm, steps_of = {}, {}
    for v in variants:
        say(f"warm-up {v.name}")
        start = time.perf_counter()
        step_times(v.model, v.dataset, max(2, warmup_steps))
        warm[v.name] = time.perf_counter() - start
        # Enough steps per round for a window of min_window_s, from a probe of `steps` steps:
        # its fastest step, so that the rounds' steps (no faster) fill the window.
        probe = min(step_times(v.model, v.dataset, steps + 1)) if min_window_s > 0 else 0.0
        steps_of[v.name] = max(steps, int(-(-min_window_s // probe)) if probe > 0 else steps)
    per_round = {v.name: [] for v in variants}
    windows = {v.name: [] for v in variants}
    for r in range(rounds):
        order = variants[r % len(variants):] + variants[:r % len(variants)]
        for v in order:
            say(f"round {r + 1}/{rounds} {v.name}")
            intervals = step_times(v.model, v.dataset, steps_of[v.name] + 1)
            per_round[v.name].append(statistics.median(intervals))
            windows[v.name].append(sum(intervals))
    out = {"rounds": rounds, "steps": steps, "min_window_s": min_window_s, "warmup_steps": warmup_steps,
           "variants": {}, "ratios": {}, "load_average": [load_before, load_average()]}
    for v in variants:
        secs = per_round[v.name]
        sps = [v.batch_size / s for s in secs]
        out["variants"][v.name] = {
            "batch_size": v.batch_size,
            "step_ms_per_round": [1e3 * s for s in secs],
            "samples_per_s": statistics.median(sps),
            "samples_per_s_min": min(sps),
            "samples_per_s_max": max(sps),
            "step_ms": 1e3 * statistics.median(secs),
            "steps_per_round": steps_of[v.name],
            "window_s": statistics.median(windows[v.name]),
            "warmup_s": warm[v.name],
        }
    for a, b in pairs:
        if a in per_round and b in per_round:
            size = {v.name: v.batch_size for v in variants}
            ratios = [(size[a] / sa) / (size[b] / sb) for sa, sb in zip(per_round[a], per_round[b])]
            out["ratios"][f"{a}/{b}"] = {"median": statistics.median(ratios), "min": min(ratios),
                                         "max": max(ratios), "per_round": ratios}
    return out
