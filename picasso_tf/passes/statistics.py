"""Warm-up statistics: ids looked up per example for each table (D-packing's Eq. 1),
and from data, how many of a batch's ids are distinct (K-packing's choice of kernel).

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
        # Typed variables: ops that read a table by handle (ResourceGatherNd) need its shape to import.
        captured.import_typed()
    per_table = collections.defaultdict(float)
    for site in analysis.sites:
        shape = graph.get_tensor_by_name(site.ids).shape
        known = shape.rank is not None and shape.rank >= 1 and all(d is not None for d in shape[1:])
        per_table[site.variable_name] += float(np.prod(shape[1:])) if known and site.combiner == "none" else 1.0
    return dict(per_table)


def warmup_statistics(captured, analysis, dataset, batches):
    """From the first `batches` batches of dataset, per table: the mean ids looked up
    per example, and the share of a batch's ids that are distinct within their site
    (how much a per-unique-row kernel saves: ids repeat in CTR data); and the examples
    per batch."""
    nodes = {node.name: node for node in captured.graph_def.node}
    ids_tensors = [_looked_up_ids(nodes, s.ids) for s in analysis.sites]

    @tf.function
    def count(features):
        ids = import_forward(captured.graph_def, captured.input_tensors,
                             conform_inputs(captured.input_specs, features),
                             captured.captures, ids_tensors, name="picasso_warmup")
        sizes = [tf.size(t, out_type=tf.int64) for t in ids]
        distinct = [tf.size(tf.unique(tf.reshape(t, [-1]))[0], out_type=tf.int64) for t in ids]
        return sizes, distinct, tf.shape(tf.nest.flatten(features)[0])[0]

    totals, distinct, examples, batches_seen = np.zeros(len(ids_tensors)), np.zeros(len(ids_tensors)), 0, 0
    for batch in dataset.take(batches):
        batches_seen += 1
        features = batch[0] if isinstance(batch, tuple) else batch
        sizes, unique, n = count(features)
        totals += np.array([int(s) for s in sizes])
        distinct += np.array([int(u) for u in unique])
        examples += int(n)
    accesses, ids, unique = (collections.defaultdict(float) for _ in range(3))
    for site, total, site_distinct in zip(analysis.sites, totals, distinct):
        accesses[site.variable_name] += total / max(examples, 1)
        ids[site.variable_name] += total
        unique[site.variable_name] += site_distinct
    return (dict(accesses), {name: unique[name] / ids[name] for name in ids if ids[name]},
            examples / max(batches_seen, 1))


def _looked_up_ids(nodes, ids):
    """The tensor holding the ids a site looks up: for safe_embedding_lookup_sparse, those
    before SparseFillEmptyRows gives each empty row an id (whose rows it then zeroes), so
    that a sequence's ids per example count its filled positions."""
    name, _, index = ids.partition(":")
    node = nodes.get(name)
    if node is None or node.op != "SparseFillEmptyRows" or index != "1":
        return ids
    source = node.input[1]
    return source if ":" in source else source + ":0"
