"""picasso_tf.compile: a model in, a Program out, with no Keras in between.

Capture traces the model's forward pass (training and inference) into GraphDefs; the
analysis finds the embedding sites; warm-up data (or the input shapes) give the
statistics the plan needs; the passes rewrite the graphs. The result is a Program
(picasso_tf.program): GraphDefs and records only. The Keras face (picasso_tf.api)
builds the storage it names and runs it.
"""
import zlib

import tensorflow as tf

from picasso_tf.config import Config
from picasso_tf.distributed.world import check_same_on_every_rank, current_world, mean_over_ranks
from picasso_tf.graph.analysis import find_embedding_sites
from picasso_tf.graph.capture import capture, input_signature
from picasso_tf.graph.common_subexpressions import merge_common_subexpressions
from picasso_tf.passes.manager import run_passes
from picasso_tf.passes.statistics import static_accesses, warmup_statistics
from picasso_tf.program import Program, Statistics


def compile_program(model, config=None, example_inputs=None, warmup_data=None, specs=None):
    """The Program of `model` (anything callable as model(inputs, training=...) whose
    variables are tf.Variables). example_inputs: a batch, for models that do not know
    their input signature; specs: the signature itself. warmup_data: a tf.data.Dataset
    of (features, label) batches whose first config.warmup_batches feed the plan."""
    config = config or Config()
    specs = specs if specs is not None else input_signature(model, example_inputs)
    graphs, merged = {}, {}
    for name in ("training", "inference"):
        graph = capture(model, specs, training=name == "training", check_numerics=config.check_numerics)
        graphs[name], merged[name] = _merged(graph) if config.merge_common_subexpressions else (graph, None)
    analyses = {name: find_embedding_sites(graph) for name, graph in graphs.items()}
    training, analysis = graphs["training"], analyses["training"]
    if warmup_data is not None and config.warmup_batches:
        accesses, distinct, batch_size = warmup_statistics(training, analysis, warmup_data, config.warmup_batches)
        statistics = Statistics(accesses, distinct, f"{config.warmup_batches} warm-up batches", batch_size)
    else:
        statistics = Statistics(static_accesses(training, analysis), {}, "input shapes")
    program = Program(graphs=graphs, analyses=analyses, statistics=agreed_by_ranks(statistics),
                      frozen=frozen_variables(model), initializers=embedding_initializers(model))
    program = run_passes(program, config)
    for name, count in merged.items():
        program.reports[name]["common_subexpressions_merged"] = count
    return program


def _merged(graph):
    """The captured graph with its common subexpressions merged, and how many nodes went
    (picasso_tf.graph.common_subexpressions)."""
    outputs = graph.output_tensors + graph.mask_tensors + graph.logit_tensors + (
        [graph.regularization_loss] if graph.regularization_loss else [])
    graph_def, replacements, count = merge_common_subexpressions(graph.graph_def, outputs)
    return graph.with_graph(graph_def, replacements, graph.captures), count


def agreed_by_ranks(statistics):
    """Under Horovod, the ranks' statistics averaged: each rank warms up on its own data,
    and every rank must make the same plan (the same graphs, hence the same collectives)."""
    if not current_world().distributed:
        return statistics
    accesses, distinct = sorted(statistics.accesses), sorted(statistics.distinct_ids)
    batch = [] if statistics.batch_size is None else [statistics.batch_size]
    check_same_on_every_rank(zlib.crc32(repr((accesses, distinct, len(batch))).encode()), "warm-up statistics")
    mean = mean_over_ranks([statistics.accesses[k] for k in accesses] + [statistics.distinct_ids[k] for k in distinct]
                           + batch)
    return Statistics(dict(zip(accesses, mean[:len(accesses)])),
                      dict(zip(distinct, mean[len(accesses):len(accesses) + len(distinct)])),
                      f"{statistics.source}, averaged over {current_world().size} ranks",
                      mean[-1] if batch else None)


def embedding_initializers(model):
    """{table name: the serialized initializer of the Keras Embedding layer owning it}."""
    if not hasattr(model, "_flatten_layers"):
        return {}
    return {layer.embeddings.name.split(":")[0]: tf.keras.initializers.serialize(layer.embeddings_initializer)
            for layer in model._flatten_layers(include_self=False)
            if isinstance(getattr(layer, "embeddings", None), tf.Variable) and hasattr(layer, "embeddings_initializer")}


def frozen_variables(model):
    """Names of the model's variables that do not train. A Keras layer made with
    trainable=False keeps trainable variables: the model's trainable_variables decide."""
    variables = list(getattr(model, "variables", ()))
    if hasattr(model, "trainable_variables"):
        training = {v.ref() for v in model.trainable_variables}
        return frozenset(v.name.split(":")[0] for v in variables if v.ref() not in training)
    return frozenset(v.name.split(":")[0] for v in variables if not v.trainable)
