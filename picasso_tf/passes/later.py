"""The pass slots whose techniques have not fully landed: caching (HybridHash), hybrid
parallelism and interleaving (micro-batches run in the training step; kernel
interleaving groups are not built). Each runs in its place in the pipeline and says
plainly what it did; asking for behaviour that does not exist yet is an error, never
a silent no-op."""
from picasso_tf.errors import UnsupportedModelError
from picasso_tf.graph.batch_coupling import batch_coupling_ops


def hybrid_hash(program, graph, config):
    raise NotImplementedError(
        "picasso_tf: the HybridHash embedding (hybrid_hash=True) is not built yet; "
        "run with hybrid_hash=False (the default)")


def distribute(program, graph, config):
    world = _horovod_world_size()
    if world > 1:
        raise NotImplementedError(
            f"picasso_tf: hybrid parallelism over {world} Horovod ranks is not built yet; "
            "run a single process, or pass distribute=False to train independent copies knowingly")
    return program, {"changed": False, "why": "single process: nothing to distribute"}


def k_interleave(program, graph, config):
    k = config.micro_batches
    if k == 1:
        return program, {"changed": False, "why": "micro_batches=1: the step runs the batch whole; "
                                                  "kernel interleaving groups are not built yet"}
    coupled = batch_coupling_ops(program.graphs[graph])
    if coupled:
        raise UnsupportedModelError(
            f"picasso_tf: micro_batches={k} runs the model on micro-batches, and {coupled[0]} "
            f"({len(coupled)} such op(s)) normalises or reduces over the batch: each micro-batch would be "
            "computed on its own, a different result from the whole batch's. Use micro_batches=1 for this model.")
    return program, {"changed": False, "micro_batches": k,
                     "why": "the training step runs the batch as micro-batches (runtime/micro_batches.py); "
                            "kernel interleaving groups are not built yet"}


def _horovod_world_size():
    try:
        import horovod.tensorflow as hvd
        return hvd.size() if hvd.is_initialized() else 1
    except (ImportError, ValueError):
        return 1
