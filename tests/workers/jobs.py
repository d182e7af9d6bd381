"""Runs several jobs of the workers here one after the other in one launch, under
`picasso-run -np N` or as one process (tests/launching.py says why).

    jobs.py JOBS_JSON

JOBS_JSON lists {"out", "worker", "args"}: each job is `worker`.main([out, *args]), run
from the directory of JOBS_JSON. After each, every rank writes status/OUT.rankR.json there:
{"error": null, or the traceback of what the job raised, "seconds": its wall time}, and
goes on with the next job. The ranks meet between jobs, so that a job may read what an
earlier one wrote.
"""
import importlib
import json
import os
import sys
import time
import traceback

import tensorflow as tf

from picasso_tf.distributed.world import launched_world


def main(listing):
    os.chdir(os.path.dirname(os.path.abspath(listing)))
    size, rank = launched_world()
    if size > 1:
        import horovod.tensorflow as hvd
        hvd.init()
    for number, job in enumerate(json.load(open(listing))):
        started = time.perf_counter()
        try:
            importlib.import_module(job["worker"]).main([job["out"], *job["args"]])
            error = None
        except (Exception, SystemExit):     # an expected refusal, or the job's test fails with it
            error = traceback.format_exc()
        status = os.path.join("status", f"{job['out']}.rank{rank}.json")
        os.makedirs(os.path.dirname(status), exist_ok=True)
        with open(status, "w") as f:
            json.dump({"error": error, "seconds": round(time.perf_counter() - started, 1)}, f)
        tf.keras.backend.clear_session()    # the next job's models start as in a fresh process
        if size > 1:
            hvd.allreduce(tf.constant(0.0), name=f"jobs_barrier_{number}").numpy()


if __name__ == "__main__":
    main(sys.argv[1])
