"""What storing tables that are read by the same ids side by side would buy (issue 38, item 4).

    python benchmarks/same_ids_stacking.py [BATCH]

DeepCTR's MLR (four regions, four learners: eight linear parts, each with a width-1
table per feature, all read by the feature's ids) against the same model written by
hand with the eight tables of a feature as the columns of one [V, 8] table (the same
L2 regulariser; one Dense(8) for the dense features' eight linear terms). Both through
stock Keras and picasso_tf, on section 8's criteo-like data, Adagrad, timed
interleaved as section 8's cells are (5 rounds of at least 1 s); prints samples/s and
the ratios. picasso_tf does not stack such tables itself (docs/benchmarks.md).
"""
import sys
import tensorflow as tf
from picasso_tf.tools.benchmarking import sections, deepctr_models
from picasso_tf.tools.benchmarking.timing import measure, Variant
batch = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
sizes = sections.MODES["full"]
data = sections.criteo_data(sizes, batch * sizes.batches, sizes.deepctr_vocab - 1)
V = sizes.deepctr_vocab

def stacked():
    s = data.schema
    inputs = {f.name: tf.keras.Input((1,), dtype=f.dtype, name=f.name) for f in s.categorical}
    inputs.update({f.name: tf.keras.Input((f.dim,), name=f.name) for f in s.dense})
    reg = tf.keras.regularizers.L2(1e-5)
    parts = [tf.keras.layers.Flatten()(tf.keras.layers.Embedding(V, 8, embeddings_regularizer=reg)(inputs[f.name]))
             for f in s.categorical]
    dense = tf.keras.layers.Concatenate()([inputs[f.name] for f in s.dense])
    logits = tf.keras.layers.Add()(parts + [tf.keras.layers.Dense(8)(dense)])
    region = tf.keras.layers.Softmax()(logits[:, :4])
    learner = tf.keras.layers.Activation("sigmoid")(logits[:, 4:])
    out = tf.keras.layers.Lambda(lambda t: tf.reduce_sum(t[0] * t[1], -1, keepdims=True), name=s.labels[0])([region, learner])
    m = tf.keras.Model(inputs, out)
    m.output_names = list(s.labels)
    return m

mlr, _ = sections.build_trio(lambda: deepctr_models.build("MLR", data.schema, V), data, batch, "adagrad", sizes, with_bound=False)
st, _ = sections.build_trio(stacked, data, batch, "adagrad", sizes, with_bound=False)
variants = [v for v in mlr.variants] + [Variant("stacked_" + v.name, v.model, v.dataset, v.batch_size) for v in st.variants]
print([v.name for v in variants], "groups", mlr.info.get("packed_groups"), st.info.get("packed_groups"))
r = measure(variants, 5, 10, 2, pairs=[("picasso", "baseline"), ("stacked_picasso", "baseline"), ("stacked_picasso", "picasso"), ("stacked_baseline", "baseline")], min_window_s=1.0)
for n, v in r["variants"].items():
    print(f"{n:18} {v['samples_per_s']:>10,.0f} samples/s ({v['samples_per_s_min']:,.0f}-{v['samples_per_s_max']:,.0f})")
for p, v in r["ratios"].items():
    print(f"{p:34} {v['median']:.2f}x ({v['min']:.2f}-{v['max']:.2f})")
print("load", r["load_average"])
