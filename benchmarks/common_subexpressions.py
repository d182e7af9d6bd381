"""The merge of common subexpressions before the step differentiates its forward
(picasso_tf.graph.common_subexpressions, option merge_common_subexpressions), on vs off.

  python benchmarks/common_subexpressions.py [MODEL[,MODEL...]] [BATCH[,BATCH...]]

Each DeepCTR model (default FwFM and DeepFEFM, the models that slice one field out of a
stack once per pair of fields) as picasso-bench's deepctr section builds it (default
hyper-parameters, criteo-like data, Adagrad), at each batch size (default 512 and 4096):
stock Keras, picasso_tf, and picasso_tf with merge_common_subexpressions=False, timed
interleaved with the suite's own harness (5 rounds of at least 1 s each). Prints
samples/s and the per-round ratios (median and range), the nodes merged, and the load
average before and after each model.
"""
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from picasso_tf.tools.benchmarking import deepctr_models, sections   # noqa: E402

OFF = "merge_off"


def run(name, batch, sizes, data):
    trio, copies = sections.build_trio(lambda: deepctr_models.build(name, data.schema, sizes.deepctr_vocab), data,
                                       batch, "adagrad", sizes, with_bound=False,
                                       extra={OFF: {"merge_common_subexpressions": False}})
    merged = copies["picasso"][1].picasso.reports["training"]["common_subexpressions_merged"]
    row = sections._timed_row(f"{name}@{batch}", trio, sizes, lambda m: None, rounds=sizes.zoo_rounds,
                              steps=sizes.zoo_steps)
    v, r = row["variants"], row["ratios"]
    print(f"{name} @{batch}: {merged} nodes merged; samples/s Keras {v['baseline']['samples_per_s']:,.0f}, "
          f"picasso {v['picasso']['samples_per_s']:,.0f}, merge off {v[OFF]['samples_per_s']:,.0f}")
    for pair in ("picasso/baseline", f"{OFF}/baseline"):
        q = r[pair]
        print(f"  {pair:22} {q['median']:.2f}x ({q['min']:.2f}-{q['max']:.2f})")
    on_off = sorted(a / b for a, b in zip(r["picasso/baseline"]["per_round"], r[f"{OFF}/baseline"]["per_round"]))
    print(f"  {'picasso/' + OFF:22} {on_off[len(on_off) // 2]:.2f}x ({on_off[0]:.2f}-{on_off[-1]:.2f})")
    print(f"  load average before {row['load_average'][0][0]:.2f}, after {row['load_average'][1][0]:.2f}",
          flush=True)


def main():
    names = sys.argv[1].split(",") if len(sys.argv) > 1 else ["FwFM", "DeepFEFM"]
    batches = [int(b) for b in sys.argv[2].split(",")] if len(sys.argv) > 2 else [512, 4096]
    sizes = sections.MODES["full"]
    data = sections.criteo_data(sizes, max(batches) * sizes.batches, sizes.deepctr_vocab - 1)
    for batch in batches:
        for name in names:
            run(name, batch, sizes, data)
            sections.cleanup()


if __name__ == "__main__":
    main()
