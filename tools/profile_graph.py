"""picasso-profile-graph: a zoo model's graph before and after picasso_tf's rewrite.

    picasso-profile-graph --model wide_deep --data criteo --out runs/profile

prints the op-count table (forward graph and whole training step, by resource class
and op type) and writes both GraphDefs as .pbtxt, a TensorBoard logdir with both graphs
and a profiler trace of a few steps, profile.txt and profile.json into --out.
"""
import argparse
import sys

import picasso_tf
from picasso_tf import models
from picasso_tf.data import generate, preset_schema
from picasso_tf.profiling.profile import format_table

PRESETS = ("criteo", "alibaba", "wide")

# The guide --help points to.
GUIDE = "docs/profiling.md"


def parse_args(argv):
    p = argparse.ArgumentParser(prog="picasso-profile-graph",
                                description=__doc__.split("\n\n")[0] + f" Guide: {GUIDE}.")
    p.add_argument("--model", default="wide_deep", help=f"zoo model: {', '.join(models.list())}")
    p.add_argument("--data", default="criteo", choices=PRESETS, help="synthetic preset for the schema and batch")
    p.add_argument("--scale", type=float, default=0.001, help="vocabulary scale of the preset (criteo)")
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--optimizer", default="adagrad")
    p.add_argument("--trace-steps", type=int, default=3, help="steps in the profiler trace (0: none)")
    p.add_argument("--out", default="runs/profile", help="directory for the artefacts")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.model not in models.list():
        print(f"picasso-profile-graph: unknown model {args.model!r}; choose one of {', '.join(models.list())}",
              file=sys.stderr)
        return 2
    schema = preset_schema(args.data, **({"scale": args.scale} if args.data == "criteo" else {}))
    missing = models.missing_inputs(args.model, schema)
    if missing:
        print(f"picasso-profile-graph: {args.model} cannot run on {args.data}: {'; '.join(missing)}",
              file=sys.stderr)
        return 2
    data = generate(schema, args.batch_size, seed=0)
    model = picasso_tf.optimize(models.build(args.model, schema))
    model.compile(optimizer=args.optimizer, loss="binary_crossentropy")
    features, labels = next(iter(data.dataset(args.batch_size)))
    report = picasso_tf.profile(model, (features, labels), out_dir=args.out, trace_steps=args.trace_steps)
    print(model.picasso.report())
    print(format_table(report))
    print(f"artefacts in {args.out}: *.pbtxt, profile.txt, profile.json, tensorboard/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
