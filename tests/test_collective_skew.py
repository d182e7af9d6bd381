"""benchmarks/collective_skew.py on a Horovod timeline recorded from a 2-rank step of
picasso_tf (tests/recorded/README.md says how)."""
import json
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import collective_skew  # noqa: E402

TIMELINE = os.path.join(ROOT, "tests", "recorded", "horovod_timeline.json")


def test_each_collective_of_the_step_is_summarised_once_per_call():
    calls = collective_skew.collective_calls(collective_skew.read_timeline(TIMELINE))
    rows = {r["collective"]: r for r in collective_skew.summary({n: c for n, c in calls.items() if len(c) > 1})}
    step = {"picasso_wide_deep/picasso_exchange_ids", "picasso_wide_deep/picasso_exchange_rows",
            "gradients/picasso_wide_deep/picasso_exchange_rows_grad", "picasso_dense_gradients"}
    assert step <= set(rows), sorted(rows)
    # The grouped Allreduce's 8 tensors are one call each step, not 8.
    assert all(rows[name]["calls"] == 6 for name in step), {n: rows[n]["calls"] for n in step}
    for name in step:
        row = rows[name]
        assert sum(row["last_to_arrive"].values()) == row["marked_calls"] and set(row["last_to_arrive"]) <= {0, 1}
        assert row["negotiation_ms"] >= 0 and all(ms > 0 for ms in row["phases_ms"].values()), row
    # An AllToAllv's negotiation and transfer, against the events read by hand.
    events = json.loads(open(TIMELINE).read().rstrip().rstrip(",") + "]")
    pid = next(e["pid"] for e in events if e.get("ph") == "M" and e.get("args", {}).get("name", "").startswith(
        "picasso_wide_deep/picasso_exchange_ids"))
    begins = {}
    spans = {"NEGOTIATE_ALLTOALL": [], "ALLTOALL": []}
    for e in events:
        if e.get("pid") == pid and e.get("ph") == "B":
            begins[e["name"]] = e["ts"]
        elif e.get("pid") == pid and e.get("ph") == "E":
            name = max(begins, key=begins.get)       # phases nest: the latest begun ends first
            if name in spans:
                spans[name].append((e["ts"] - begins[name]) / 1e3)
            del begins[name]
    row = rows["picasso_wide_deep/picasso_exchange_ids"]
    assert row["negotiation_ms"] == statistics.median(spans["NEGOTIATE_ALLTOALL"])
    assert row["phases_ms"]["ALLTOALL"] == statistics.median(spans["ALLTOALL"])
