"""Times fbgemm's CPU TableBatchedEmbedding (forward + backward with its fused exact
SGD update) on the ids that benchmarks/lookup_kernel.py saved; prints ms per step.

Runs in a separate venv with torch 2.13.0 + fbgemm-gpu-cpu 1.8.0 (not a project
dependency): `<venv>/bin/python benchmarks/fbgemm_tbe_worker.py IDS.npz DIM STEPS`.
"""
import statistics
import sys
import time

import numpy as np
import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (ComputeDevice,
                                                                    SplitTableBatchedEmbeddingBagsCodegen)


def main(ids_path, dim, steps):
    ids = np.load(ids_path)["ids"]                      # [fields, batch]
    fields, batch = ids.shape
    vocab = int(np.load(ids_path)["vocab"])
    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        embedding_specs=[(vocab, dim, EmbeddingLocation.HOST, ComputeDevice.CPU)] * fields,
        optimizer=EmbOptimType.EXACT_SGD, learning_rate=0.01, pooling_mode=PoolingMode.SUM)
    indices = torch.from_numpy(ids.reshape(-1).astype(np.int64))        # table-major bags of one id
    offsets = torch.arange(fields * batch + 1, dtype=torch.int64)
    upstream = torch.randn(batch, fields * dim)
    times = []
    for step in range(steps + 2):
        start = time.perf_counter()
        tbe(indices, offsets).backward(upstream)
        if step >= 2:
            times.append(time.perf_counter() - start)
    print(f"{statistics.median(times) * 1e3:.3f}")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
