"""Table VI on this machine: HybridHash's hot tier (Algorithm 1, paper §III-D) on Zipf ids,
its hit ratio beside an LRU cache and the Belady bound of the same size, and samples/s;
then lookahead refresh (Bagpipe's idea) beside refresh from past counts.

    .venv/bin/python benchmarks/hot_tier.py [--zipf 1.05 1.2 1.5] [--shares 0.01 0.05 0.2]
        [--vocab 100000] [--batch 256] [--ids-per-example 16] [--steps 500] [--warmup 100]
        [--refresh 100] [--rounds 15] [--timed-steps 20] [--lookahead 100:100 10:10 10:100 1:1]
        [--fit-lookahead 10:10 100:100] [--fit-rounds 3] [--simulate-only | --fit-only]

One Keras model (an embedding table of --vocab rows, dim 16, looked up by --ids-per-example
ids per example, averaged, and a sigmoid unit; Adagrad) trains through
picasso_tf.optimize(hybrid_hash=True) on a stream of --steps batches of Zipf ids (ranks
mapped to ids by a random permutation), with a hot tier of each share of the stream's
distinct ids. A hit is one of a step's distinct ids that the cache held when the step
began; a hit ratio is hits / distinct ids summed over the steps after the warm-up.
Algorithm 1's is read from the storage's counters (and checked against a NumPy replica);
on the same stream, in NumPy: an LRU cache (the ids looked up last), Belady's MIN
(clairvoyant: keeps the ids looked up again soonest; the optimum of caches that take an id
in when a step looks it up) and the best fixed set (clairvoyant: the ids looked up in most
steps, held throughout). Then every model, with hybrid_hash=False and a hash-backed model
without a hot tier beside, is timed interleaved (picasso_tf.tools.benchmarking.measure) on
a few more batches of the stream. Prints a table and writes it to --out.

The second table is NumPy on the same streams and hot-tier sizes: a hot set refreshed
before step --warmup and every R steps after, either from past counts (Algorithm 1's
choice; R=--refresh is Algorithm 1 itself) or from the ids of the next K batches, as a
training loop that peeks K batches ahead of a tf.data pipeline could (--lookahead R:K;
it holds the ids looked up in most of those K steps, then by past counts, then the
smaller id). Beside each hit ratio, the rows taken into the tier per step: what the
refreshes move from the cold tier. LRU and Belady's MIN take a row in on every miss they
admit, so a lookahead refreshed every step can pass Belady's hit ratio (it prefetches)
at about LRU's traffic. --simulate-only prints this table alone (no model, no timing)
and writes no file unless --out names one.

The third table runs those refreshes through fit on the real storage: Algorithm 1
(hot_refresh="counts", refreshed inside the step) and hot_refresh="lookahead" for each
--fit-lookahead R:K (fit reads the dataset K batches ahead and refreshes between steps),
beside hybrid_hash=False: samples/s of fitting the stream after the warm-up batches
(--fit-rounds interleaved rounds, a fresh model each), and the hit ratio from the
storage's counters beside the NumPy simulation's of the same refreshes. --fit-only prints
it alone and writes no file unless --out names one.
"""
import argparse
import dataclasses
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TARGET = (1.05, 0.05, 0.97)     # the issue's target: Zipf 1.05, 5% of the distinct ids, >= 0.97x Belady


def commit():
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip() or "?"
    except (OSError, subprocess.SubprocessError):
        return "?"


def percent(row, key):
    return f"{100 * row[key]:.1f}%" if key in row else "–"


def line(row):
    hot = f"{row['hot_rows']:,} ({100 * row['share']:g}%)" if row.get("hot_rows") else "–"
    speed = f"{row['samples_per_s']:,.0f} ({row['samples_per_s_min']:,.0f}-{row['samples_per_s_max']:,.0f})"
    r = row.get("vs_hybrid_hash_false")
    versus = f"{r['median']:.2f}x ({r['min']:.2f}-{r['max']:.2f})" if r else "–"
    ratio = f"{row['algorithm1/belady']:.3f}" if "algorithm1/belady" in row else "–"
    return (f"{row['zipf']:<5} {row['variant']:<18} {hot:>16} {percent(row, 'algorithm1'):>8} "
            f"{percent(row, 'lru'):>7} {percent(row, 'belady'):>7} {percent(row, 'best_fixed_set'):>7} {ratio:>8}  "
            f"{speed:>26} {versus:>19} {percent(row, 'timed_hit_ratio'):>8}")


def refreshed_hits(distinct, vocab, capacity, first, every, horizon):
    """Per step, the hits of a hot set refreshed before step `first` and every `every`
    steps after, holding the `capacity` ids looked up in most of the next `horizon` steps
    (0: past counts alone, Algorithm 1), then in most of the steps before, then the
    smaller id; and the ids taken in by each step's refresh."""
    import numpy as np
    past, held, hits, taken = np.zeros(vocab, np.int64), np.zeros(vocab, bool), [], []
    order = np.arange(vocab)
    for step, ids in enumerate(distinct):
        took = 0
        if step >= first and (step - first) % every == 0:
            future = np.zeros(vocab, np.int64)
            for later in distinct[step:step + horizon]:
                future[later] += 1
            chosen = np.zeros(vocab, bool)
            chosen[np.lexsort((order, -past, -future))[:capacity]] = True
            took, held = int((chosen & ~held).sum()), chosen
        hits.append(int(held[ids].sum()))
        taken.append(took)
        past[ids] += 1
    return np.array(hits), np.array(taken)


def lookahead_table(sizes, exponent, shares, schedules, say):
    """Hit ratios (and rows taken in per step) of past-count and lookahead refresh, LRU and
    Belady on the stream hot_tier_sweep trains on; returns the rows."""
    import numpy as np
    from picasso_tf.tools.benchmarking import sections
    stream = sections.zipf_stream(sizes.hot_steps + sizes.batches, sizes.hot_batch, sizes.hot_ids_per_example,
                                  sizes.hot_vocab, exponent, sizes.seed)[:sizes.hot_steps]
    distinct = [np.unique(b) for b in stream]
    seen, first = int(np.unique(stream).size), sizes.hot_warmup
    looked_up = sum(ids.size for ids in distinct[first:])
    steps = len(distinct) - first
    rows = []
    for share in shares:
        capacity = max(1, round(share * seen))     # as hot_tier_sweep sizes the tier
        row = {"zipf": exponent, "share": share, "hot_rows": capacity, "policies": {}}
        for every in sorted({r for r, _ in schedules} | {sizes.hot_refresh}, reverse=True):
            for horizon in [0] + [k for r, k in schedules if r == every]:
                hits, taken = refreshed_hits(distinct, sizes.hot_vocab, capacity, first, every, horizon)
                if horizon == 0 and every == sizes.hot_refresh:
                    replica = sections.algorithm1_hits(distinct, sizes.hot_vocab, capacity, first, every)
                    if not np.array_equal(hits, replica):
                        raise AssertionError("past-count refresh differs from sections.algorithm1_hits")
                name = f"past R={every}" if horizon == 0 else f"ahead R={every} K={horizon}"
                row["policies"][name] = (hits[first:].sum() / looked_up, taken[first:].sum() / steps)
        row["lru"] = sections.lru_hits(stream, sizes.hot_vocab, capacity)[first:].sum() / looked_up
        row["belady"] = sections.belady_hits(distinct, sizes.hot_vocab, capacity)[first:].sum() / looked_up
        rows.append(row)
    names = list(rows[0]["policies"])
    say(f"Zipf {exponent}: {seen:,} distinct ids, {np.mean([d.size for d in distinct]):,.0f} per step; hit ratio "
        "(rows taken in per step) over the steps after the warm-up; x Belady below")
    say(f"{'share':>6} {'rows':>7}" + "".join(f" {n:>19}" for n in names) + f" {'LRU':>19} {'Belady':>19}")
    misses = looked_up / steps       # per step, times (1 - hit ratio): what LRU takes in, Belady at most
    for row in rows:
        cells = [(h, t) for h, t in row["policies"].values()] + [(row[c], misses * (1 - row[c])) for c in
                                                                 ("lru", "belady")]
        say(f"{100 * row['share']:>5g}% {row['hot_rows']:>7,}" +
            "".join(f" {100 * h:>9.1f}% ({t:>6,.0f})" for h, t in cells))
        say(f"{'':>6} {'':>7}" + "".join(f" {h / row['belady']:>18.3f}x" for h, _ in cells))
    return rows


def timed_table(sizes, args, say):
    """The models on the streams: Algorithm 1 from the storage's counters, LRU, Belady, the
    best fixed set, and samples/s."""
    from picasso_tf.tools.benchmarking import sections
    rows = []
    for exponent in args.zipf:
        found = sections.hot_tier_sweep(sizes, exponent, lambda m: print(f"  .. {m}", file=sys.stderr, flush=True))
        say(f"Zipf {exponent}: {found[0]['distinct_ids']:,} distinct ids in the stream, "
            f"{found[0]['distinct_per_step']:,.0f} per step on average; load average {os.getloadavg()[0]:.1f}")
        for row in found:
            say(line(row))
        rows += found
        sections.cleanup()
    off = [r["name"] for r in rows if "algorithm1" in r and abs(r["algorithm1"] - r["algorithm1_numpy"]) > 1e-12]
    say()
    say("Algorithm 1: the storage's counters " + (f"DIFFER from the NumPy replica in: {', '.join(off)}" if off
                                                  else "equal the NumPy replica's hit ratio in every row"))
    zipf, share, floor = TARGET
    hit = next((r for r in rows if r["zipf"] == zipf and r.get("share") == share and "belady" in r), None)
    if hit:
        say(f"target (issue 22): Algorithm 1 >= {floor}x Belady at a hot tier of {100 * share:g}% of the distinct ids "
            f"on Zipf {zipf}: {hit['algorithm1/belady']:.3f}x ({100 * hit['algorithm1']:.1f}% against "
            f"{100 * hit['belady']:.1f}%): {'met' if hit['algorithm1/belady'] >= floor else 'NOT met'}; the best fixed "
            f"set, which past counts can at most find, is {hit['best_fixed_set'] / hit['belady']:.3f}x Belady")
    say("columns: 'fixed' = best fixed set; 'timed hit' = the hot tier's hit ratio while timed (the timed batches "
        "repeat, so their ids gain counts); samples/s with no GPU: the hot tier is a CPU array, both tiers in DRAM")


def simulation_table(sizes, args, schedules, say):
    """The NumPy table of refresh policies, and the issue's target with lookahead."""
    say()
    say(f"Lookahead refresh (Bagpipe) beside refresh from past counts, NumPy on the same streams: the hot set "
        f"refreshed before step {args.warmup} and every R steps after, from past counts ('past R', R={args.refresh} "
        "is Algorithm 1) or from the ids of the next K batches ('ahead R K'); rows taken in = rows the refreshes "
        "move into the tier (LRU takes in every miss, Belady at most every miss: their misses are shown)")
    ahead = []
    for exponent in args.zipf:
        ahead += lookahead_table(sizes, exponent, args.shares, schedules, say)
    zipf, share, floor = TARGET
    hit = next((r for r in ahead if r["zipf"] == zipf and r["share"] == share), None)
    if hit:
        best = max(hit["policies"].items(), key=lambda kv: kv[1][0])
        say(f"target (issue 22) with lookahead: >= {floor}x Belady at {100 * share:g}% on Zipf {zipf}: "
            + ", ".join(f"{n} {h / hit['belady']:.3f}x" for n, (h, _) in hit["policies"].items())
            + f"; best {best[0]}: {'met' if best[1][0] / hit['belady'] >= floor else 'NOT met'} (a refresh from "
            "the next batches prefetches rows before they are looked up, which Belady's bound on caches that take a "
            "row in on a miss does not cover: compare the rows taken in)")


def refreshes(parser, option, given):
    """[(R, K)] of an option's R:K values (exits with an error naming the option if one is not)."""
    try:
        schedules = [tuple(int(v) for v in r_k.split(":")) for r_k in given]
    except ValueError:
        schedules = []
    if not schedules or any(len(rk) != 2 or min(rk) < 1 for rk in schedules):
        parser.error(f"{option} {' '.join(given)}: give each refresh as R:K, both at least 1 (e.g. 10:10)")
    return schedules


def fit_table(sizes, args, schedules, say):
    """Through fit on the real storage: samples/s and hit ratio of Algorithm 1 (counts,
    refreshed in the step) and of lookahead refresh (hot_refresh="lookahead": fit reads the
    dataset ahead and refreshes between steps) on the stream, beside hybrid_hash=False."""
    import statistics
    import time
    import numpy as np
    import tensorflow as tf
    import picasso_tf
    from picasso_tf.tools.benchmarking import sections
    first, row_bytes = sizes.hot_warmup, 2 * sizes.hot_dim * 4 + 16
    for exponent in args.zipf:
        stream = sections.zipf_stream(sizes.hot_steps + sizes.batches, sizes.hot_batch, sizes.hot_ids_per_example,
                                      sizes.hot_vocab, exponent, sizes.seed)[:sizes.hot_steps]
        labels = (np.random.default_rng(sizes.seed).random(stream.shape[:2]) < 0.5).astype("float32")
        data = tf.data.Dataset.from_tensor_slices(({"ids": stream}, labels))
        distinct = [np.unique(b) for b in stream]
        looked_up = sum(ids.size for ids in distinct[first:])
        base = sections._hot_tier_model(sizes)
        for share in args.shares:
            capacity = max(1, round(share * int(np.unique(stream).size)))
            hot = {"hybrid_hash": True, "hot_storage_bytes": capacity * row_bytes}
            variants = {"hybrid_hash=False": ({}, None),
                        f"past R={sizes.hot_refresh}": (dict(hot, hot_warmup_steps=first,
                                                             hot_refresh_every=sizes.hot_refresh),
                                                        (sizes.hot_refresh, 0))}
            for every, ahead in schedules:
                variants[f"ahead R={every} K={ahead}"] = (dict(hot, hot_refresh="lookahead", hot_refresh_every=every,
                                                               hot_lookahead_batches=ahead), (every, ahead))
            speeds, ratios = {name: [] for name in variants}, {name: set() for name in variants}
            for r in range(args.fit_rounds):
                names = list(variants)
                for name in names[r % len(names):] + names[:r % len(names)]:
                    options, _ = variants[name]
                    copy = sections._hot_tier_model(sizes)
                    copy.set_weights(base.get_weights())
                    model = sections._compile(picasso_tf.optimize(copy, **options), "adagrad")
                    model.fit(data.take(first), verbose=0)      # traces the step; Algorithm 1's warm-up
                    before = sections._hot_counters(model) if options else None
                    start = time.perf_counter()
                    model.fit(data.skip(first), verbose=0)
                    speeds[name].append((sizes.hot_steps - first) * sizes.hot_batch / (time.perf_counter() - start))
                    if before:
                        hits, lookups = (b - a for a, b in zip(before, sections._hot_counters(model)))
                        ratios[name].add(hits / lookups)
                    sections.cleanup()
            say(f"Zipf {exponent}, hot tier {capacity:,} rows ({100 * share:g}%): "
                f"load average {os.getloadavg()[0]:.1f}")
            say(f"{'model':<22} {'hit ratio':>9} {'NumPy':>7} {'x Belady':>8} {'samples/s':>26} {'/ past':>7}")
            belady = sections.belady_hits(distinct, sizes.hot_vocab, capacity)[first:].sum() / looked_up
            past = statistics.median(speeds[f"past R={sizes.hot_refresh}"])
            for name, (options, schedule) in variants.items():
                if len(ratios[name]) > 1:
                    raise AssertionError(f"{name}: the hit ratio differs between rounds: {sorted(ratios[name])}")
                cells = ["–", "–", "–"]
                if schedule is not None:
                    simulated = refreshed_hits(distinct, sizes.hot_vocab, capacity, first, *schedule)[0]
                    ratio, = ratios[name]
                    cells = [f"{100 * ratio:.1f}%", f"{100 * simulated[first:].sum() / looked_up:.1f}%",
                             f"{ratio / belady:.3f}x"]
                speed = speeds[name]
                say(f"{name:<22} {cells[0]:>9} {cells[1]:>7} {cells[2]:>8} {statistics.median(speed):>11,.0f} "
                    f"({min(speed):,.0f}-{max(speed):,.0f}) {statistics.median(speed) / past:>6.2f}x")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--zipf", type=float, nargs="+", default=[1.05, 1.2, 1.5])
    p.add_argument("--shares", type=float, nargs="+", default=[0.01, 0.05, 0.2],
                   help="hot-tier sizes as shares of the stream's distinct ids")
    p.add_argument("--vocab", type=int, default=100_000)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--ids-per-example", type=int, default=16)
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--refresh", type=int, default=100)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--timed-steps", type=int, default=20)
    p.add_argument("--lookahead", nargs="+", default=["100:100", "10:10", "10:100", "1:1"], metavar="R:K",
                   help="lookahead refreshes: every R steps from the next K batches (past counts every R beside)")
    p.add_argument("--fit-lookahead", nargs="+", default=["10:10", "100:100"], metavar="R:K",
                   help="lookahead refreshes fit makes through the real storage (hot_refresh='lookahead')")
    p.add_argument("--fit-rounds", type=int, default=3)
    p.add_argument("--fit-only", action="store_true",
                   help="only the table of refreshes through fit (no file unless --out names one)")
    p.add_argument("--simulate-only", action="store_true",
                   help="only the NumPy table of refresh policies (no model, no timing)")
    p.add_argument("--out", help="default: benchmarks/hot_tier.txt; none with --simulate-only")
    args = p.parse_args(argv)
    schedules, fit_schedules = (refreshes(p, option, given) for option, given in
                                [("--lookahead", args.lookahead), ("--fit-lookahead", args.fit_lookahead)])

    import tensorflow as tf
    from picasso_tf.tools.benchmarking import sections

    sizes = dataclasses.replace(
        sections.MODES["full"], hot_zipf=tuple(args.zipf), hot_storage_sizes=tuple(args.shares),
        hot_vocab=args.vocab, hot_batch=args.batch, hot_ids_per_example=args.ids_per_example,
        hot_steps=args.steps, hot_warmup=args.warmup, hot_refresh=args.refresh, rounds=args.rounds,
        steps=args.timed_steps)
    out = []

    def say(text=""):
        print(text, flush=True)
        out.append(text)

    say("HybridHash's hot tier (Algorithm 1) on Zipf ids: hit ratio beside LRU and the Belady bound, and samples/s")
    say("command: " + " ".join([os.path.relpath(sys.executable, ROOT),
                                os.path.relpath(os.path.abspath(sys.argv[0]), ROOT)] + sys.argv[1:]))
    say(f"machine: {os.cpu_count()} cores, shared with other work (load average {os.getloadavg()[0]:.1f} at "
        f"start); TensorFlow {tf.__version__}; commit {commit()}")
    say(f"stream: {args.steps} steps of {args.batch} x {args.ids_per_example} ids over {args.vocab:,}; one table of "
        f"dim {sizes.hot_dim}, Adagrad; warm-up {args.warmup} steps, hot set refreshed every {args.refresh}")
    if not (args.simulate_only or args.fit_only):
        say(f"hit ratios over steps {args.warmup + 1}-{args.steps}; samples/s: median (min-max) over {args.rounds} "
            f"interleaved rounds of {args.timed_steps} steps on {sizes.batches} more batches, repeated")
        say()
        say(f"{'zipf':<5} {'model':<18} {'hot rows (share)':>16} {'Alg. 1':>8} {'LRU':>7} {'Belady':>7} {'fixed':>7} "
            f"{'A1/Bel.':>8}  {'samples/s':>26} {'/ hybrid_hash=False':>19} {'timed hit':>8}")
        timed_table(sizes, args, say)
    if not args.fit_only:
        simulation_table(sizes, args, schedules, say)
    if not args.simulate_only:
        say()
        say(f"Through fit on the real storage: Algorithm 1 ('past R={args.refresh}', refreshed in the step) and "
            "hot_refresh='lookahead' ('ahead R K': fit reads the dataset K batches ahead and refreshes between steps, "
            f"from step {args.warmup} on) on the stream, beside hybrid_hash=False: each model fitted on the first "
            f"{args.warmup} batches, then timed fitting the other {args.steps - args.warmup} (samples/s: median "
            f"(min-max) over {args.fit_rounds} interleaved rounds, fresh models; / past: against Algorithm 1's); "
            "hit ratio from the storage's counters over those steps, 'NumPy' the simulation's of the same refreshes")
        fit_table(sizes, args, fit_schedules, say)
    out_path = args.out or (None if args.simulate_only or args.fit_only else os.path.join(HERE, "hot_tier.txt"))
    if out_path:
        with open(out_path, "w") as f:
            f.write("\n".join(out) + "\n")


if __name__ == "__main__":
    main()
