"""Where a multi-rank step's collectives spend their wall time, from a Horovod timeline:
waiting for the last rank to reach them, or moving bytes.

    HOROVOD_TIMELINE=/tmp/timeline.json picasso-run -np 2 python train.py
    python benchmarks/collective_skew.py /tmp/timeline.json

Horovod's timeline (written by rank 0) records, per tensor and per collective call, a
negotiation phase that opens when the first rank submits the tensor and closes when
the last one has (with a mark per rank as it arrives), then the collective itself.
Per collective called more than once (a grouped Allreduce by its first tensor,
"NAME_1ofN"), over its calls: the median negotiation (how long the first rank to submit
waited for the others), how often each rank arrived last (over the calls that mark
the ranks' arrivals: Horovod does not for a call its response cache answers), and the
median of the collective itself. Negotiation is skew between the ranks (their steps drifting apart),
which fewer collectives per step, not a faster transport, would save.
"""
import collections
import json
import re
import statistics
import sys


def read_timeline(path):
    """The timeline's events; Horovod leaves the JSON array open while it writes."""
    text = open(path).read().rstrip().rstrip(",")
    return json.loads(text if text.endswith("]") else text + "]")


def collective_calls(events):
    """{collective name: [call]}, each call {"negotiation": (start, end) µs, "arrivals":
    {rank: µs}, "phases": {top-level phase: µs}}, in order. A grouped collective's
    tensors ("NAME_iofN") share its calls: only its first tensor is read."""
    names = {e["pid"]: e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name" and "name" in e.get("args", {})}
    calls = collections.defaultdict(list)
    per_tensor = collections.defaultdict(list)
    for e in events:
        if e.get("ph") in ("B", "E", "X"):
            per_tensor[e["pid"]].append(e)
    for pid, tensor_events in per_tensor.items():
        name = names.get(pid, str(pid))
        grouped = re.search(r"_(\d+)of\d+$", name)
        if grouped and grouped.group(1) != "1":
            continue
        # Horovod names a tensor by its op: keep the op's scope, the collective's name.
        name = re.sub(r"_1of\d+$", "", name.split("/Horovod")[0])
        open_phases, call = [], None
        for e in tensor_events:
            if e["ph"] == "B":
                if e["name"].startswith("NEGOTIATE"):
                    call = {"negotiation": None, "arrivals": {}, "phases": {}, "start": e["ts"]}
                    calls[name].append(call)
                open_phases.append(e)
            elif e["ph"] == "X" and call is not None and call["negotiation"] is None and e["name"].isdigit():
                call["arrivals"][int(e["name"])] = e["ts"]
            elif e["ph"] == "E" and open_phases:
                begun = open_phases.pop()
                if call is None:
                    continue
                if begun["name"].startswith("NEGOTIATE"):
                    call["negotiation"] = (begun["ts"], e["ts"])
                elif not open_phases:
                    call["phases"][begun["name"]] = e["ts"] - begun["ts"]
    return {name: [c for c in cs if c["negotiation"] is not None] for name, cs in calls.items()}


def summary(calls):
    """Per collective name, the figures of the module docstring (ms)."""
    rows = []
    for name, cs in sorted(calls.items()):
        if not cs:
            continue
        waits = [(c["negotiation"][1] - c["negotiation"][0]) / 1e3 for c in cs]
        last = collections.Counter(max(c["arrivals"], key=c["arrivals"].get) for c in cs if c["arrivals"])
        phases = collections.defaultdict(list)
        for c in cs:
            for phase, us in c["phases"].items():
                phases[phase].append(us / 1e3)
        rows.append({"collective": name, "calls": len(cs), "negotiation_ms": statistics.median(waits),
                     "last_to_arrive": dict(sorted(last.items())), "marked_calls": sum(last.values()),
                     "phases_ms": {p: statistics.median(v) for p, v in phases.items()}})
    return rows


def main(argv=None):
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    calls = collective_calls(read_timeline(args[0]))
    once = [name for name, cs in calls.items() if len(cs) == 1]
    for row in summary({name: cs for name, cs in calls.items() if len(cs) > 1}):
        phases = ", ".join(f"{p} {ms:.2f}" for p, ms in row["phases_ms"].items())
        print(f"{row['collective']}: {row['calls']} calls; negotiation {row['negotiation_ms']:.2f} ms "
              f"(last to arrive, by rank, in the {row['marked_calls']} calls marking it: {row['last_to_arrive']}); "
              f"{phases} ms (medians)")
    if once:
        print(f"{len(once)} collectives called once (start-up broadcasts and the like) not shown")
    return 0


if __name__ == "__main__":
    sys.exit(main())
