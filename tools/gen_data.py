"""picasso-gen-data: writes a synthetic dataset (picasso_tf.data.synthetic) to disk.

    picasso-gen-data --preset criteo --rows 200000 --out DIR [--format parquet] [--seed 0]

writes DIR/data.parquet (or data.tfrecord, data.csv) and DIR/schema.json beside it,
generating and writing chunk by chunk so that memory stays bounded. --format csv
writes the criteo preset in Criteo's own CSV form (header, hex categoricals: read it
with read_criteo) and the other presets in the generic form of write_csv (read_csv).
"""
import argparse
import os
import sys
import time

from picasso_tf.data import (generate_chunks, preset_schema, read_criteo, read_csv, read_parquet,
                             read_tfrecord, write_criteo, write_csv, write_parquet, write_tfrecord)

# The options of each preset's schema function that the command line exposes.
PRESET_OPTIONS = {
    "criteo": ("scale", "max_buckets"),
    "alibaba": ("num_onehot", "num_sequences", "seq_len", "vocab_size"),
    "wide": ("num_fields", "vocab_size"),
}
FORMATS = ("parquet", "tfrecord", "csv")

# The guide --help points to.
GUIDE = "docs/getting-started.md"


def writer_and_reader(preset, file_format):
    """(writer, reader, the reader's extra arguments as text) for a preset and format."""
    if file_format == "parquet":
        return write_parquet, read_parquet, ""
    if file_format == "tfrecord":
        return write_tfrecord, read_tfrecord, ""
    if preset == "criteo":   # the generated dense values are already log-scaled
        return (lambda data, path: write_criteo(data, path, delimiter=",", header=True)), read_criteo, \
            ", dense_transform=None"
    return write_csv, read_csv, ""


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="picasso-gen-data",
                                     description=__doc__.split("\n\n")[0] + f" Guide: {GUIDE}.")
    parser.add_argument("--preset", required=True, choices=sorted(PRESET_OPTIONS))
    parser.add_argument("--rows", required=True, type=int, help="number of examples")
    parser.add_argument("--out", required=True, help="output directory (created if needed)")
    parser.add_argument("--format", default="parquet", choices=FORMATS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--zipf-exponent", type=float, default=1.2, help="of the id distribution (default 1.2)")
    parser.add_argument("--chunk-rows", type=int, default=100_000, help="examples generated and written at once")
    presets = parser.add_argument_group("preset options (defaults: those of the preset's schema function)")
    presets.add_argument("--scale", type=float, help="criteo: multiply the Kaggle cardinalities")
    presets.add_argument("--max-buckets", type=int, help="criteo: cap every cardinality")
    presets.add_argument("--num-onehot", type=int, help="alibaba: one-hot features")
    presets.add_argument("--num-sequences", type=int, help="alibaba: behaviour sequences")
    presets.add_argument("--seq-len", type=int, help="alibaba: ids per sequence")
    presets.add_argument("--num-fields", type=int, help="wide: one-hot features")
    presets.add_argument("--vocab-size", type=int, help="alibaba, wide: ids per feature including id 0")
    args = parser.parse_args(argv)
    given = {k for ks in PRESET_OPTIONS.values() for k in ks if getattr(args, k) is not None}
    foreign = sorted(given - set(PRESET_OPTIONS[args.preset]))
    if foreign:
        parser.error(f"--preset {args.preset} takes none of "
                     + ", ".join("--" + k.replace("_", "-") for k in foreign))
    if args.rows < 1 or args.chunk_rows < 1:
        parser.error("--rows and --chunk-rows must be positive")
    args.schema_options = {k: getattr(args, k) for k in PRESET_OPTIONS[args.preset] if getattr(args, k) is not None}
    return args


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    schema = preset_schema(args.preset, **args.schema_options)
    os.makedirs(args.out, exist_ok=True)
    write, reader, reader_options = writer_and_reader(args.preset, args.format)
    data_path = os.path.join(args.out, "data." + args.format)
    schema_path = os.path.join(args.out, "schema.json")
    start = time.perf_counter()
    write(generate_chunks(schema, args.rows, args.chunk_rows, args.seed, zipf_exponent=args.zipf_exponent),
          data_path)
    schema.save(schema_path)
    print(f"wrote {args.rows} examples of {args.preset} ({len(schema.features)} features) in "
          f"{time.perf_counter() - start:.1f} s:\n  {data_path} ({os.path.getsize(data_path) / 1e6:.1f} MB)\n"
          f"  {schema_path}\nread them back with:\n"
          f"  from picasso_tf.data import Schema, {reader.__name__}\n"
          f"  dataset = {reader.__name__}({data_path!r}, Schema.load({schema_path!r}){reader_options})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
