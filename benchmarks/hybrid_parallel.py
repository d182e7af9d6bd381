"""Hybrid parallelism on loopback: 1 process against `picasso-run -np 2` (MPI, or Gloo with
--transport gloo), for zoo models on the synthetic criteo preset, with each rank on 1
intra-op and 1 inter-op thread and the same per-rank batch. Prints:

  1. samples per CPU-second (time.process_time over the timed steps, summed over the
     ranks) of the 2-rank run as a share of the 1-rank run's, and wall-clock figures;
  2. bytes on the wire per rank and step against the analytic minimum (distinct ids
     per remote owner x (8 + 2·D·4), plus 2(P-1)/P of the Allreduced bytes);
  3. collectives per step, read from Horovod's timeline;
  4. a projection to 8, 64 and 256 ranks from the measured per-rank costs;
  5. what a rank holds (bytes in its variables, resident memory) with every table
     sharded, against one process, on dlrm with large tables;
  6. the float16 wire (wire_dtype="float16"): bytes per rank and step against float32's
     with every table sharded, and held-out AUC after training each --wire-models model
     for --wire-steps steps of --wire-batch per rank on 2 ranks, float32 against float16.

    .venv/bin/python benchmarks/hybrid_parallel.py [--models wide_deep,dlrm] [--batch 2048]
        [--steps 40] [--repeats 2] [--big-batch 8192] [--memory-buckets 50000]
        [--wire-models wide_deep,dlrm] [--wire-batch 256] [--wire-steps 400] [--heldout 20000]
        [--transport mpi|gloo]

Each configuration runs benchmarks/hybrid_parallel_worker.py: timed runs carry no
timeline and no counters (both cost CPU, the timeline a lot on rank 0); a separate
short instrumented run per configuration gives the bytes, the timeline and the
loopback bandwidth.
"""
import argparse
import collections
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from picasso_tf.config import Config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = os.path.join(ROOT, ".venv", "bin", "python")
PICASSO_RUN = os.path.join(ROOT, ".venv", "bin", "picasso-run")
WORKER = os.path.join(ROOT, "benchmarks", "hybrid_parallel_worker.py")

# The projection's network: a 25 Gbit/s link per rank, and a per-message latency (one
# message per peer in an AllToAllv, 2(P-1) in a ring Allreduce) typical of TCP over
# Ethernet. Both are assumptions, not measurements.
LINK_BYTES_PER_S = 25e9 / 8
MESSAGE_LATENCY_S = 10e-6
PROJECTED_RANKS = (8, 64, 256)


def run_worker(out, model, batch, warmup, steps, size, replicate_below=None, instrument=False, timeline=None,
               buckets=None, wire_dtype="float32", heldout=0, transport="mpi", stock=None):
    """Runs one configuration (`stock`: the stock Keras model, see the worker's --stock) on
    `size` ranks over `transport`; returns the ranks' result dicts."""
    shutil.rmtree(out, ignore_errors=True)
    args = [WORKER, out, "--model", model, "--batch", str(batch), "--warmup", str(warmup), "--steps", str(steps),
            "--wire-dtype", wire_dtype, "--heldout", str(heldout)]
    if buckets is not None:
        args += ["--buckets", str(buckets)]
    if replicate_below is not None:
        args += ["--replicate-below", str(replicate_below)]
    if instrument:
        args.append("--instrument")
    if stock:
        args += ["--stock", stock]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1")
    env.pop("HOROVOD_TIMELINE", None)
    if timeline:
        env["HOROVOD_TIMELINE"] = timeline
    command = [PY] + args if size == 1 else [PICASSO_RUN, "-np", str(size), f"--{transport}", PY] + args
    done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        sys.exit(f"worker failed ({done.returncode}): {' '.join(command)}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    ranks = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(size)]
    if size > 1 and ranks[0]["transport"] != transport:
        sys.exit(f"asked for {transport}, the worker ran on {ranks[0]['transport']}: {' '.join(command)}")
    return ranks


# -- Horovod's timeline ----------------------------------------------------------------------------

def read_timeline(path):
    text = open(path).read().rstrip().rstrip(",")
    if not text.endswith("]"):
        text += "]"           # Horovod leaves the array open while the job runs
    return json.loads(text)


def collectives_per_step(path):
    """Per timed step (the last complete ones in the timeline): the AllToAllv and
    Allreduce activities, the tensors' bytes the Allreduces carried, and how many
    Allreduce executions those tensors were fused into."""
    events = read_timeline(path)
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name" and "name" in e.get("args", {})}
    begins = [e for e in events if e.get("ph") == "B"]
    markers = [e["ts"] for e in begins if e["name"] == "NEGOTIATE_ALLTOALL" and names[e["pid"]].endswith("picasso_exchange_ids")]
    if not markers:   # nothing exchanged: steps start at the dense Allreduce's first tensor
        markers = [e["ts"] for e in begins if e["name"] == "NEGOTIATE_ALLREDUCE"
                   and names[e["pid"]].startswith("picasso_dense_gradients_1of")]
    # Each activity's interval, to merge the tensors one fused Allreduce ran together.
    stacks, intervals = collections.defaultdict(list), []
    for e in events:
        if e.get("ph") == "B":
            stacks[e["pid"]].append(e)
        elif e.get("ph") == "E" and stacks[e["pid"]]:
            b = stacks[e["pid"]].pop()
            intervals.append((b["name"], names.get(e["pid"], "?"), b["ts"], e["ts"], e.get("args") or {}))
    steps = []
    for start, end in zip(markers[-6:-1], markers[-5:]):
        inside = [i for i in intervals if start <= i[2] < end]
        alltoall = collections.Counter(_short(n) for kind, n, *_ in inside if kind == "ALLTOALL")
        allreduce = sorted((s, t) for kind, n, s, t, _ in inside if kind in ("GLOO_ALLREDUCE", "MPI_ALLREDUCE"))
        fused, last_end = 0, -1
        for s, t in allreduce:
            fused += s > last_end
            last_end = max(last_end, t)
        # The dtype and shape Horovod records when a tensor's activity ends (once per tensor).
        reduced = sum(_nbytes(a) for kind, n, _, _, a in inside if "shape" in a and kind != "ALLTOALL"
                      and not n.startswith("HorovodBroadcast"))
        other = collections.Counter(kind for kind, *_ in inside
                                    if kind in ("BROADCAST", "ALLGATHER", "REDUCESCATTER"))
        steps.append({"alltoall": dict(alltoall), "allreduce_tensors": len(allreduce), "allreduce_fused": fused,
                      "allreduce_bytes": reduced, "other": dict(other)})
    return steps


def _short(name):
    if name.endswith("picasso_exchange_ids"):
        return "ids"
    if name.endswith("picasso_exchange_rows"):
        return "rows"
    if "picasso_exchange_rows_grad" in name:
        return "row gradients"
    return name


def _nbytes(args):
    size = {"float32": 4, "int64": 8, "float64": 8, "int32": 4, "float16": 2}[args["dtype"]]
    for d in args["shape"].strip("[]").split(","):
        if d.strip():
            size *= int(d)
    return size


# -- one model, one configuration ------------------------------------------------------------------

def measure(model, label, replicate_below, args, work, single_runs):
    """The 2-rank timed runs and the instrumented run of one configuration."""
    timed = []
    for r in range(args.repeats):
        timed.append(run_worker(os.path.join(work, f"{model}_{label}_2_{r}"), model, args.batch, args.warmup,
                                args.steps, 2, replicate_below, transport=args.transport))
    timeline = os.path.join(work, f"{model}_{label}_timeline.json")
    instrumented = run_worker(os.path.join(work, f"{model}_{label}_inst"), model, args.batch, 8, 10, 2,
                              replicate_below, instrument=True, timeline=timeline, transport=args.transport)
    # The float16 wire changes only the exchange: measured where every group is exchanged.
    half = run_worker(os.path.join(work, f"{model}_{label}_half"), model, args.batch, 8, 10, 2, replicate_below,
                      instrument=True, wire_dtype="float16", transport=args.transport) if replicate_below == 0 else None
    return {"label": label, "replicate_below": replicate_below, "timed": timed, "instrumented": instrumented,
            "timeline": collectives_per_step(timeline), "single": single_runs, "half": half}


def cpu_figures(single_runs, timed, batch, steps):
    """Samples per CPU-second and per wall-second: 1 rank, and 2 ranks over both."""
    one_cpu = [batch * steps / r[0]["cpu_s"] for r in single_runs]
    one_wall = [batch * steps / r[0]["wall_s"] for r in single_runs]
    two_cpu = [batch * steps * len(r) / sum(x["cpu_s"] for x in r) for r in timed]
    two_wall = [batch * steps * len(r) / max(x["wall_s"] for x in r) for r in timed]
    per_rank_cpu_ms = [[1e3 * x["cpu_s"] / steps for x in r] for r in timed]
    return {"one_cpu": one_cpu, "one_wall": one_wall, "two_cpu": two_cpu, "two_wall": two_wall,
            "per_rank_cpu_ms": per_rank_cpu_ms, "one_cpu_ms": [1e3 * r[0]["cpu_s"] / steps for r in single_runs],
            "ratio": statistics.mean(two_cpu) / statistics.mean(one_cpu),
            "wall_ratio": statistics.mean(two_wall) / statistics.mean(one_wall)}


def wire_figures(config, size=2, runs="instrumented"):
    """Per rank and step: the analytic minimum and what the exchange really sent."""
    inst, steps = config[runs], config[runs][0]["steps"]
    share = 2 * (size - 1) / size
    rows = []
    for r in inst:
        minimum_exchange = r["analytic"]["remote_bytes"] if r["distribute"].get("sharded") else 0.0
        if r["wire_dtype"] == "float16":       # 8 bytes per id, 2·D·2 per row and row gradient
            ids = 8 * r["analytic"]["remote_ids"]
            minimum_exchange = ids + (minimum_exchange - ids) / 2
        sent = {k: sum(b for d, b in enumerate(r.get(f"alltoall_{k}_bytes", [0] * size)) if d != r["rank"]) / steps
                for k in ("ids", "rows", "grads")}
        tl = config["timeline"]
        reduced_tl = statistics.mean(s["allreduce_bytes"] for s in tl) if tl else 0.0
        reduced_graph = r.get("allreduce_bytes", 0) / steps
        minimum_allreduce = share * r["dense_bytes"]
        if not r["distribute"].get("sharded"):
            minimum_allreduce = share * (r["dense_bytes"] + r["table_bytes"])   # the tables are Allreduced too
        actual = sum(sent.values()) + share * reduced_tl
        rows.append({"rank": r["rank"], "min_exchange": minimum_exchange, "min_allreduce": minimum_allreduce,
                     "sent": sent, "reduced_timeline": reduced_tl, "reduced_graph": reduced_graph,
                     "actual": actual, "min": minimum_exchange + minimum_allreduce,
                     "sharded_scheme_min": r["analytic"]["remote_bytes"] + share * r["dense_bytes"]})
    timed = config["timed"]
    lo = statistics.mean(sum(x["lo_bytes"] for x in run[:1]) / (steps_of(run) * size) for run in timed)
    return rows, lo


def steps_of(run):
    return run[0]["steps"]


def project(single, config, cpu, bandwidth, sizes=PROJECTED_RANKS):
    """Per-rank step time at P ranks = 1-rank compute per step + the measured extra CPU
    per step of the 2-rank run (exchange ops, Horovod's per-collective work; held
    constant in P) + wire bytes / bandwidth + per-message latency. No overlap of
    communication with compute is assumed."""
    r = config["instrumented"][0]
    batch = r["batch"]
    compute = statistics.mean(cpu["one_cpu_ms"]) / 1e3
    overhead = max(0.0, statistics.mean(statistics.mean(x) for x in cpu["per_rank_cpu_ms"]) / 1e3 - compute)
    sharded = bool(r["distribute"].get("sharded"))
    distinct = statistics.mean(x[0]["analytic"]["distinct_bytes"] for x in single) if sharded else 0.0
    allreduced = r["dense_bytes"] + (0 if sharded else r["table_bytes"])
    out = []
    for p in sizes:
        exchange = distinct * (p - 1) / p
        allreduce = 2 * (p - 1) / p * allreduced
        latency = MESSAGE_LATENCY_S * ((3 * (p - 1) if sharded else 0) + 2 * (p - 1))
        step = compute + overhead + (exchange + allreduce) / bandwidth + latency
        out.append({"P": p, "bytes": exchange + allreduce, "bytes_per_sample": (exchange + allreduce) / batch,
                    "step_ms": 1e3 * step, "net_ms": 1e3 * ((exchange + allreduce) / bandwidth + latency),
                    "global": p * batch / step, "efficiency": compute / step})
    return compute, overhead, out


# -- printing ----------------------------------------------------------------------------------------

def fmt(x):
    return f"{x:,.0f}"


def report(model, configs, args):
    single = configs[0]["single"]
    r0 = configs[0]["instrumented"][0]
    groups = ", ".join(f"{g['tables']}x d{g['dim']}" for g in r0["groups"])
    print(f"\n=== {model}: {r0['tables']} tables in {len(r0['groups'])} packed groups "
          f"({groups}), table bytes {fmt(r0['table_bytes'])}, "
          f"dense parameter bytes {fmt(r0['dense_bytes'])}; batch {args.batch} per rank")
    print("\n1. samples per CPU-second (time.process_time of each rank over "
          f"{args.steps} steps after {args.warmup} warm-up; {args.repeats} runs)")
    print(f"  {'configuration':<38}{'CPU ms/step/rank':>22}{'samples/CPU-s':>16}{'x 1 rank':>10}"
          f"{'wall samples/s':>16}{'x 1 rank':>10}")
    cpu_one = cpu_figures(single, configs[0]["timed"], args.batch, args.steps)
    print(f"  {'1 process (no Horovod)':<38}{' / '.join(f'{x:.1f}' for x in cpu_one['one_cpu_ms']):>22}"
          f"{fmt(statistics.mean(cpu_one['one_cpu'])):>16}{'1.00':>10}{fmt(statistics.mean(cpu_one['one_wall'])):>16}"
          f"{'1.00':>10}")
    figures = {}
    for c in configs:
        cpu = cpu_figures(single, c["timed"], args.batch, args.steps)
        figures[c["label"]] = cpu
        per_rank = " / ".join("+".join(f"{x:.1f}" for x in run) for run in cpu["per_rank_cpu_ms"])
        print(f"  {'2 ranks, ' + c['label']:<38}{per_rank:>22}{fmt(statistics.mean(cpu['two_cpu'])):>16}"
              f"{cpu['ratio']:>10.2f}{fmt(statistics.mean(cpu['two_wall'])):>16}{cpu['wall_ratio']:>10.2f}")
    print("  (2 ranks: global samples over the sum of both ranks' CPU seconds; target >= 0.85 of 1 process's;"
          " wall: 2 ranks on 2 shared cores)")

    print("\n2. bytes on the wire per rank and step, against the analytic minimum")
    for c in configs:
        rows, lo = wire_figures(c)
        d = c["instrumented"][0]["distribute"]
        print(f"  {c['label']}: sharded groups {len(d.get('sharded') or [])}, replicated "
              f"{len(d.get('replicated') or {})}")
        for w in rows:
            sent = w["sent"]
            print(f"    rank {w['rank']} sent: ids {fmt(sent['ids'])} (its requests) + rows {fmt(sent['rows'])} (served "
                  f"to the other) + row gradients {fmt(sent['grads'])} (its rows back) + 2(P-1)/P x allreduced "
                  f"{fmt(w['reduced_timeline'])}; its minimum {fmt(w['min'])} (exchange {fmt(w['min_exchange'])} "
                  f"+ allreduce {fmt(w['min_allreduce'])})")
        # The minimum charges a row to the rank that asks for it, the counters to the rank
        # that sends it: they agree over all ranks, not rank by rank.
        actual, minimum = sum(w["actual"] for w in rows) / len(rows), sum(w["min"] for w in rows) / len(rows)
        print(f"    per rank over both: actual {fmt(actual)} against minimum {fmt(minimum)}: "
              f"{actual / minimum:.3f}x the minimum")
        print(f"    loopback interface: {fmt(lo)} bytes per rank and step (all traffic: payload, Horovod's "
              f"negotiation, TCP/IP headers)")
        if d.get("replicated"):
            print(f"    the same batches fully sharded would need {fmt(rows[0]['sharded_scheme_min'])} per rank "
                  f"and step (rank 0)")

    print("\n3. collectives per step (Horovod timeline of rank 0's coordinator, last 5 steps)")
    for c in configs:
        kinds = {json.dumps(s, sort_keys=True) for s in c["timeline"]}
        for k in sorted(kinds):
            s = json.loads(k)
            a2a = ", ".join(f"{v} {n}" for n, v in sorted(s["alltoall"].items())) or "none"
            print(f"  {c['label']}: AllToAllv: {a2a}; Allreduce: {s['allreduce_tensors']} tensors in "
                  f"{s['allreduce_fused']} fused execution(s), {fmt(s['allreduce_bytes'])} bytes"
                  + (f"; other: {s['other']}" if s["other"] else "")
                  + f"  ({sum(1 for x in c['timeline'] if json.dumps(x, sort_keys=True) == k)} of "
                    f"{len(c['timeline'])} steps)")
    return figures


def report_wire_bytes(configs):
    """Bytes per rank and step, float32 against float16 on the wire (every group sharded)."""
    for c in configs:
        if c["half"] is None:
            continue
        full, half = wire_figures(c)[0], wire_figures(c, runs="half")[0]
        print(f"  {c['label']}:")
        for f, h in zip(full, half):
            exchanged = [w["sent"]["rows"] + w["sent"]["grads"] for w in (f, h)]
            print(f"    rank {f['rank']}: rows {fmt(f['sent']['rows'])} -> {fmt(h['sent']['rows'])}, row gradients "
                  f"{fmt(f['sent']['grads'])} -> {fmt(h['sent']['grads'])} ({exchanged[1] / exchanged[0]:.3f}x), "
                  f"ids {fmt(f['sent']['ids'])} -> {fmt(h['sent']['ids'])}; all with the Allreduce "
                  f"{fmt(f['actual'])} -> {fmt(h['actual'])} ({h['actual'] / f['actual']:.3f}x)")
        actual, minimum = (sum(w[k] for w in half) / len(half) for k in ("actual", "min"))
        print(f"    float16, per rank over both: actual {fmt(actual)} against its minimum (8 per id, 2·D·2 per row "
              f"and row gradient) {fmt(minimum)}: {actual / minimum:.3f}x")


def report_wire_quality(work, models, batch, steps, heldout, transport):
    """Held-out AUC after training on 2 ranks, every group sharded, float32 against float16."""
    print(f"\n  held-out AUC: {steps} steps of {batch} per rank on 2 ranks (every group sharded, Adam), then "
          f"{heldout} held-out examples of the same data")
    print(f"  {'model':<12}{'wire':<10}{'AUC':>8}{'log loss':>10}{'CPU ms/step/rank':>20}{'wall s':>9}")
    for model in models:
        for wire in ("float32", "float16"):
            ranks = run_worker(os.path.join(work, f"quality_{model}_{wire}"), model, batch, 1, steps - 1, 2, 0,
                               wire_dtype=wire, heldout=heldout, transport=transport)
            r = ranks[0]
            per_rank = "+".join(f"{1e3 * x['cpu_s'] / x['steps']:.1f}" for x in ranks)
            print(f"  {model:<12}{wire:<10}{r['heldout_auc']:>8.4f}{r['heldout_log_loss']:>10.4f}{per_rank:>20}"
                  f"{r['wall_s']:>9.1f}")


def report_memory(work, buckets, transport, model="dlrm", batch=4096):
    """What a rank holds with every table sharded, against one process."""
    runs = {size: run_worker(os.path.join(work, f"memory_{size}"), model, batch, 3, 5, size, 0, buckets=buckets,
                             transport=transport)
            for size in (1, 2)}
    one = runs[1][0]
    print(f"\nmemory: {model} with {buckets} rows per table ({runs[1][0]['tables']} tables, table bytes "
          f"{fmt(one['table_bytes'])}), Adam (2 slots per table), batch {batch}, after training 8 steps; "
          "variables: bytes in every variable's buffer (tables, slots, shards, dense part)")
    print(f"  1 process:     variables {fmt(one['variable_bytes'])}, resident {fmt(one['rss_bytes'])}, "
          f"peak resident {fmt(one['peak_rss_bytes'])}")
    for r in runs[2]:
        print(f"  2 ranks, rank {r['rank']}: variables {fmt(r['variable_bytes'])} "
              f"({r['variable_bytes'] / one['variable_bytes']:.2f}x), resident {fmt(r['rss_bytes'])}, "
              f"peak resident {fmt(r['peak_rss_bytes'])}")


def report_projection(model, configs, figures, loopback):
    print(f"\n4. projection for {model} (a cost model, not a measurement): per-rank step = 1-process CPU per step"
          " + the 2-rank run's extra CPU per step (held constant) + bytes / bandwidth + "
          f"{MESSAGE_LATENCY_S * 1e6:.0f} us per message")
    for c in configs:
        for bw_name, bw in (("25 Gbit/s", LINK_BYTES_PER_S), (f"loopback {loopback * 8 / 1e9:.1f} Gbit/s", loopback)):
            compute, overhead, rows = project(c["single"], c, figures[c["label"]], bw)
            print(f"  {c['label']}, {bw_name}: compute {compute * 1e3:.1f} ms + collective overhead "
                  f"{overhead * 1e3:.1f} ms per step")
            for p in rows:
                print(f"    P={p['P']:>3}: {fmt(p['bytes'])} bytes/rank/step ({p['bytes_per_sample']:.0f}/sample), "
                      f"network {p['net_ms']:.2f} ms, step {p['step_ms']:.1f} ms, {fmt(p['global'])} samples/s "
                      f"global, efficiency {p['efficiency']:.2f}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="wide_deep,dlrm")
    parser.add_argument("--transport", choices=("mpi", "gloo"), default="mpi", help="of the 2-rank runs")
    parser.add_argument("--batch", type=int, default=2048)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--big-batch", type=int, default=8192, help="wide_deep sharded again at this batch (0: skip)")
    parser.add_argument("--wire-models", default="wide_deep,dlrm", help="held-out AUC, float32 and float16 wire "
                        "('': skip)")
    parser.add_argument("--wire-batch", type=int, default=256)
    parser.add_argument("--wire-steps", type=int, default=400)
    parser.add_argument("--heldout", type=int, default=20000)
    parser.add_argument("--memory-buckets", type=int, default=50000,
                        help="dlrm with tables of this many rows, 1 process against 2 ranks all sharded: what a "
                             "rank holds (0: skip)")
    args = parser.parse_args()
    began = time.perf_counter()
    work = tempfile.mkdtemp(prefix="hybrid_parallel_")
    print(f"$ {' '.join(['.venv/bin/python', 'benchmarks/hybrid_parallel.py'] + sys.argv[1:])}")
    print(f"host: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at start; 2 ranks over "
          f"{args.transport}")
    loopbacks, wire_configs = [], {}
    for model in args.models.split(","):
        single = [run_worker(os.path.join(work, f"{model}_1_{r}"), model, args.batch, args.warmup, args.steps, 1)
                  for r in range(args.repeats)]
        configs = [measure(model, "all sharded (replicate_tables_below=0)", 0, args, work, single),
                   measure(model, f"default (replicate_tables_below={Config().replicate_tables_below >> 20} MiB)",
                           None, args, work, single)]
        figures = report(model, configs, args)
        wire_configs[model] = configs
        loopback = statistics.mean(r["loopback_bytes_per_s"] for c in configs for r in c["instrumented"])
        loopbacks.append(loopback)
        report_projection(model, configs, figures, loopback)
    if args.big_batch:
        b = args.big_batch
        steps = 10
        one = run_worker(os.path.join(work, "big_1"), "wide_deep", b, 4, steps, 1)
        two = run_worker(os.path.join(work, "big_2"), "wide_deep", b, 4, steps, 2, 0, transport=args.transport)
        one_rate = b * steps / one[0]["cpu_s"]
        two_rate = 2 * b * steps / sum(x["cpu_s"] for x in two)
        per_rank = " + ".join(f"{1e3 * x['cpu_s'] / steps:.1f}" for x in two)
        print(f"\nwide_deep all sharded at batch {b} per rank ({steps} steps): 1 process {fmt(one_rate)} samples/CPU-s "
              f"({1e3 * one[0]['cpu_s'] / steps:.1f} ms/step); 2 ranks {fmt(two_rate)} "
              f"({per_rank} ms/step): {two_rate / one_rate:.2f}x")
    if args.memory_buckets:
        report_memory(work, args.memory_buckets, args.transport)
    print(f"\nloopback AllToAllv bandwidth (64 MiB, one rank to the other): "
          f"{statistics.mean(loopbacks) * 8 / 1e9:.1f} Gbit/s")
    print('\n6. the float16 wire (wire_dtype="float16"): bytes per rank and step, float32 -> float16 (rows and '
          f"row gradients; instrumented runs of 10 steps, batch {args.batch} per rank)")
    for model, configs in wire_configs.items():
        print(f"  {model}:")
        report_wire_bytes(configs)
    if args.wire_models:
        report_wire_quality(work, args.wire_models.split(","), args.wire_batch, args.wire_steps, args.heldout,
                            args.transport)
    print(f"total {time.perf_counter() - began:.0f} s")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
