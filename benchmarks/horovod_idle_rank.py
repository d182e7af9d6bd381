"""One rank of a Horovod launch that trains as one process: Horovod is initialised (its
background thread cycles and talks to the other ranks), but picasso_tf sees a world of
one and the step issues no collective. Beside plain processes and real 2-rank runs it
separates what Horovod's runtime costs a rank from what the step's collectives cost
(docs/benchmarks.md, "What Horovod's runtime costs a rank").

    picasso-run -np 2 --mpi .venv/bin/python benchmarks/horovod_idle_rank.py OUT_DIR WORKER_ARGS...

Each rank runs benchmarks/hybrid_parallel_worker.py WORKER_ARGS as one process and writes
OUT_DIR/r<RANK>/rank0.json.
"""
import os
import runpy
import sys

import horovod.tensorflow as hvd

hvd.init()
RANK = hvd.rank()
hvd.is_initialized = lambda: False      # picasso_tf asks Horovod for its world: it sees one process
for name in list(os.environ):           # and so does the worker, which reads the launcher's variables
    if name.startswith(("OMPI_COMM_WORLD", "PMIX_RANK", "HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL",
                        "OMPI_UNIVERSE", "PMI_")):
        del os.environ[name]
sys.argv = ["hybrid_parallel_worker.py", os.path.join(sys.argv[1], f"r{RANK}")] + sys.argv[2:]
runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "hybrid_parallel_worker.py"), run_name="__main__")
