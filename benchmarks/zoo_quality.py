"""Trains every zoo model with its default short-training recipe and prints the quality
table of models/README.md: trainable parameters at default size on MovieLens-100K, test
AUC on MovieLens' seeded random 80/20 split and on its time-ordered split, and the gap
to the planted model's AUC on the zoo's synthetic task (see models/quality.py).

    .venv/bin/python benchmarks/zoo_quality.py                 # everything (7.5 min on 2 shared cores)
    .venv/bin/python benchmarks/zoo_quality.py --models din,dien --tasks random
    .venv/bin/python benchmarks/zoo_quality.py --json results.json
"""
import argparse
import json
import os
import pathlib
import platform
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

TASKS = ("random", "time", "synthetic")


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main(argv=None):
    import picasso_tf.models as zoo
    from picasso_tf.models import quality

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(zoo.list()), help="comma-separated zoo names")
    parser.add_argument("--tasks", default=",".join(TASKS), help=f"comma-separated subset of {TASKS}")
    parser.add_argument("--seed", type=int, default=0, help="training seed (data splits are fixed)")
    parser.add_argument("--json", help="also write the rows to this JSON file")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    for n in names:
        zoo.info(n)                     # unknown names fail here, listing the valid ones
    bad = set(tasks) - set(TASKS)
    if bad:
        parser.error(f"unknown tasks {sorted(bad)}; choose from {TASKS}")

    print(f"# zoo quality: {' '.join(['.venv/bin/python', 'benchmarks/zoo_quality.py'] + (argv or sys.argv[1:]))}")
    print(f"# machine: {os.cpu_count()} cores, {cpu_model()}; TensorFlow {tf.__version__}")
    data = {}
    if "random" in tasks or "time" in tasks:
        data["random"] = quality.movielens("random")
    if "time" in tasks:
        data["time"] = quality.movielens("time")
    if "synthetic" in tasks:
        data["synthetic"] = {lin: quality.synthetic(linear=lin) for lin in (False, True)}
        print(f"# synthetic planted AUC: {data['synthetic'][False][2]:.4f} "
              f"(linear task for LR: {data['synthetic'][True][2]:.4f}); "
              f"{quality.SYNTHETIC_ROWS} rows, 80/20")

    schema = (data.get("random") or quality.movielens("random"))[0].schema
    header = ["model", "params (MovieLens)", "random AUC", "time AUC", "synthetic AUC", "planted", "gap",
              "train s"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    rows = []
    for name in names:
        row = {"model": name, "params": quality.default_size(name, schema)}
        seconds = 0.0
        for task in ("random", "time"):
            if task in tasks:
                train, test = data[task]
                result = zoo.build_and_train(name, train, test, seed=args.seed)
                row[f"{task}_auc"] = result.test_auc
                seconds += result.train_seconds
                tf.keras.backend.clear_session()
        if "synthetic" in tasks:
            train, test, planted = data["synthetic"][quality.synthetic_is_linear(name)]
            result = zoo.build_and_train(name, train, test, seed=args.seed, **quality.synthetic_recipe(name))
            row.update(synthetic_auc=result.test_auc, planted_auc=planted, gap=planted - result.test_auc)
            seconds += result.train_seconds
            tf.keras.backend.clear_session()
            if quality.synthetic_is_linear(name):     # and on the planted model it cannot represent
                train, test, planted_full = data["synthetic"][False]
                full = zoo.build_and_train(name, train, test, seed=args.seed, **quality.synthetic_recipe(name))
                row["gap_full_task"] = planted_full - full.test_auc
                tf.keras.backend.clear_session()
        row["train_seconds"] = seconds
        rows.append(row)

        def fmt(key, spec=".4f"):
            return format(row[key], spec) if key in row else "-"
        gap = fmt("gap", "+.4f") + (f" (full task {row['gap_full_task']:+.4f})" if "gap_full_task" in row else "")
        print(f"| {name} | {row['params']:,} | {fmt('random_auc')} | {fmt('time_auc')} | "
              f"{fmt('synthetic_auc')} | {fmt('planted_auc')} | {gap} | {seconds:.0f} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    failed = [r["model"] for r in rows
              if r.get("random_auc", 1.0) < quality.AUC_LIMIT or r.get("gap", 0.0) > quality.GAP_LIMIT]
    print(f"# bars: random AUC >= {quality.AUC_LIMIT}, planted gap <= {quality.GAP_LIMIT}: "
          + ("all met" if not failed else f"missed by {failed}"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
