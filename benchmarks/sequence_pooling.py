"""Sequence pooling in the fused lookup (issue 24, item 3): what it gains on the zoo
models that sum or average sequence features, against the same rewrite without it and
against plain Keras.

  python benchmarks/sequence_pooling.py [--batch 1024] [--models mmoe,din,...]

MMoE on the paper's layout (94 fields, 10 sequences of 50 ids); the other zoo models
on picasso-bench's alibaba-like data (6 behaviour sequences of 50 ids), those whose
rewrite pools a sequence. Per model: samples/s of Keras, of picasso_tf with
sequence_pooling=False and with it on (Adagrad, one batch repeated, the order of the
runs alternating round by round), the per-round median ratios, and the training
step's op counts.
"""
import argparse
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import tensorflow as tf       # noqa: E402

from dense_packing import alternating   # noqa: E402

ZOO = ("mmoe", "din", "dien", "dsin", "two_tower", "star", "atbrg", "wide_deep", "deepfm", "xdeepfm")


def _data(name, batch, sizes):
    from picasso_tf.data import generate
    from tools.benchmarking.sections import alibaba_data, paper_schema
    if name == "mmoe":
        schema = paper_schema(name, 1.0, vocab=sizes.scaling_vocab, seq_len=sizes.alibaba_seq_len)
        return schema, generate(schema, batch, seed=0, zipf_exponent=sizes.zipf)
    data = alibaba_data(sizes, batch)
    return data.schema, data


def measure(name, batch):
    import picasso_tf
    from tools.benchmarking.models import targets
    from tools.benchmarking.sections import NotApplicable, Sizes, zoo_builder
    sizes = Sizes()
    schema, data = _data(name, batch, sizes)
    try:
        build = zoo_builder(name, schema, data, sizes, limit_feeders=True)
    except NotApplicable as e:
        return f"  {name}: not applicable ({e})"
    x = {k: tf.constant(v) for k, v in data.features.items()}
    runs, ops, pooled = {}, {}, []
    for variant, options in (("on", {}), ("off", {"sequence_pooling": False}), ("keras", None)):
        tf.keras.utils.set_random_seed(0)
        model = build()
        y = tf.nest.map_structure(tf.constant, targets(model, data.label_dict))
        if options is not None:
            model = picasso_tf.optimize(model, example_inputs=x, **options)
        model.compile(optimizer=tf.keras.optimizers.Adagrad(0.01), loss="binary_crossentropy")
        model.train_on_batch(x, y)
        runs[variant] = (lambda m=model, y=y: m.train_on_batch(x, y))
        if options is not None:
            ops[variant] = picasso_tf.profile(model, (x, y))["ops"]["step_picasso"]["total"]
            if variant == "on":
                [report] = [p for p in model.picasso.reports["training"]["passes"] if p["pass"] == "k_packing"]
                pooled = report["sequences_pooled"]
                if not pooled:
                    return f"  {name}: pools no sequence"
    seconds, ratios = alternating({n: runs[n] for n in ("keras", "off", "on")})
    on_vs_off = seconds["off"] / seconds["on"]
    return (f"  {name} ({len(pooled)} poolings of {len(set(pooled))} sequences): Keras {batch / seconds['keras']:,.0f} samples/s, off "
            f"{batch / seconds['off']:,.0f} ({ratios['off']:.2f}x Keras), on {batch / seconds['on']:,.0f} "
            f"({ratios['on']:.2f}x Keras; {on_vs_off:.2f}x off); step ops {ops['off']:,} -> {ops['on']:,}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--models", default=",".join(ZOO))
    args = parser.parse_args()
    tf.config.threading.set_inter_op_parallelism_threads(2)
    print(f"load average {os.getloadavg()[0]:.1f}, TensorFlow {tf.__version__}, batch {args.batch}, Adagrad(0.01); "
          "samples/s are per-round medians; ratios per-round medians of the time ratio")
    for name in args.models.split(","):
        print(measure(name, args.batch), flush=True)
