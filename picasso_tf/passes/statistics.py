"""Warm-up statistics for D-packing's Eq. 1: ids looked up per example for each table.

From data: the sites' id tensors are computed on the first batches. Without data: from
the static shapes of the id tensors (one id per one-hot feature, max_len per sequence).
"""
import collections

import numpy as np
import tensorflow as tf

from picasso_tf.graph.rebuild import conform_inputs, import_forward


def static_accesses(captured, analysis):
    graph = tf.Graph()
    with graph.as_default():
        tf.graph_util.import_graph_def(captured.graph_def, name="")
    per_table = collections.defaultdict(float)
    for site in analysis.sites:
        shape = graph.get_tensor_by_name(site.ids).shape
        known = shape.rank is not None and shape.rank >= 1 and all(d is not None for d in shape[1:])
        per_table[site.variable_name] += float(np.prod(shape[1:])) if known and site.combiner == "none" else 1.0
    return dict(per_table)


def warmup_accesses(captured, analysis, dataset, batches):
    """Mean ids per example over the first `batches` batches of dataset."""
    ids_tensors = [s.ids for s in analysis.sites]

    @tf.function
    def count(features):
        ids = import_forward(captured.graph_def, captured.input_tensors,
                             conform_inputs(captured.input_specs, features),
                             captured.captures, ids_tensors, name="picasso_warmup")
        return [tf.size(t, out_type=tf.int64) for t in ids], tf.shape(tf.nest.flatten(features)[0])[0]

    totals, examples = np.zeros(len(ids_tensors)), 0
    for batch in dataset.take(batches):
        features = batch[0] if isinstance(batch, tuple) else batch
        sizes, n = count(features)
        totals += np.array([int(s) for s in sizes])
        examples += int(n)
    per_table = collections.defaultdict(float)
    for site, total in zip(analysis.sites, totals):
        per_table[site.variable_name] += total / max(examples, 1)
    return dict(per_table)
