"""What storing tables that are read by the same ids side by side would buy (issue 38, item 4).

    python benchmarks/same_ids_stacking.py [--model MLR|WDL] [--batch 4096]

A DeepCTR model against the same model written by hand with the tables that one
feature's ids read as the column ranges of one wider table (the same L2 regulariser
on it):
- MLR: four regions and four learners, eight linear parts, each with a width-1 table
  per feature; stacked, one [V, 8] table per feature (and one Dense(8) for the dense
  features' eight linear terms).
- WDL: a width-1 linear table and a width-8 DNN table per feature; stacked, one [V, 9]
  table, column 0 the linear part's.
Both through stock Keras and picasso_tf, on section 8's criteo-like data, Adagrad, timed
interleaved as section 8's cells are (5 rounds of at least 1 s); prints samples/s and
the ratios. picasso_tf does not stack such tables itself (docs/benchmarks.md).
"""
import argparse

import tensorflow as tf

from picasso_tf.tools.benchmarking import deepctr_models, sections
from picasso_tf.tools.benchmarking.timing import Variant, measure, summary_lines

L2 = 1e-5       # DeepCTR's default l2_reg_linear and l2_reg_embedding


def feature_inputs(schema):
    inputs = {f.name: tf.keras.Input((1,), dtype=f.dtype, name=f.name) for f in schema.categorical}
    inputs.update({f.name: tf.keras.Input((f.dim,), name=f.name) for f in schema.dense})
    return inputs


def stacked_lookups(schema, inputs, vocab, width):
    """Per categorical feature, its [batch, width] row of one stacked table."""
    reg = tf.keras.regularizers.L2(L2)
    return [tf.keras.layers.Flatten()(tf.keras.layers.Embedding(vocab, width, embeddings_regularizer=reg)(inputs[f.name]))
            for f in schema.categorical]


def named(inputs, output, schema):
    model = tf.keras.Model(inputs, output)
    model.output_names = list(schema.labels)
    return model


def stacked_mlr(schema, vocab):
    inputs = feature_inputs(schema)
    dense = tf.keras.layers.Concatenate()([inputs[f.name] for f in schema.dense])
    logits = tf.keras.layers.Add()(stacked_lookups(schema, inputs, vocab, 8) + [tf.keras.layers.Dense(8)(dense)])
    region = tf.keras.layers.Softmax()(logits[:, :4])
    learner = tf.keras.layers.Activation("sigmoid")(logits[:, 4:])
    out = tf.keras.layers.Lambda(lambda t: tf.reduce_sum(t[0] * t[1], -1, keepdims=True),
                                 name=schema.labels[0])([region, learner])
    return named(inputs, out, schema)


def stacked_wdl(schema, vocab):
    inputs = feature_inputs(schema)
    rows = stacked_lookups(schema, inputs, vocab, 1 + deepctr_models.EMBEDDING_DIM)
    dense = tf.keras.layers.Concatenate()([inputs[f.name] for f in schema.dense])
    linear = tf.keras.layers.Add()([r[:, :1] for r in rows] + [tf.keras.layers.Dense(1, use_bias=False)(dense)])
    deep = tf.keras.layers.Concatenate()([r[:, 1:] for r in rows] + [dense])
    for units in (256, 128, 64):        # DeepCTR's default dnn_hidden_units
        deep = tf.keras.layers.Dense(units, activation="relu")(deep)
    logit = tf.keras.layers.Add()([linear, tf.keras.layers.Dense(1, use_bias=False)(deep)])
    return named(inputs, tf.keras.layers.Dense(1, activation="sigmoid", name=schema.labels[0])(logit), schema)


STACKED = {"MLR": stacked_mlr, "WDL": stacked_wdl}


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=sorted(STACKED), default="MLR")
    parser.add_argument("--batch", type=int, default=4096)
    args = parser.parse_args(argv)
    sizes = sections.MODES["full"]
    vocab = sizes.deepctr_vocab
    data = sections.criteo_data(sizes, args.batch * sizes.batches, vocab - 1)
    original, _ = sections.build_trio(lambda: deepctr_models.build(args.model, data.schema, vocab), data,
                                      args.batch, "adagrad", sizes, with_bound=False)
    stacked, _ = sections.build_trio(lambda: STACKED[args.model](data.schema, vocab), data, args.batch, "adagrad",
                                     sizes, with_bound=False)
    variants = original.variants + [Variant("stacked_" + v.name, v.model, v.dataset, v.batch_size)
                                    for v in stacked.variants]
    result = measure(variants, sizes.zoo_rounds, 10, sizes.warmup_steps, min_window_s=sizes.min_window_s,
                     pairs=[("picasso", "baseline"), ("stacked_picasso", "baseline"),
                            ("stacked_picasso", "picasso"), ("stacked_baseline", "baseline")])
    print(f"{args.model} at batch {args.batch}; load average before / after: {result['load_average']}")
    print("\n".join(summary_lines(result)))


if __name__ == "__main__":
    main()
