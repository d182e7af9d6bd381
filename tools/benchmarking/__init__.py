"""The benchmark suite behind picasso-bench (tools/bench.py): its sections, the models and
batches they time, interleaved timing, per-op breakdowns, isolated stages and the report."""
