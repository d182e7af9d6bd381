"""The pass slots whose techniques have not landed yet: caching (HybridHash) and hybrid
parallelism. Each runs in its place in the pipeline and says plainly what it did;
asking for behaviour that does not exist yet is an error, never a silent no-op."""


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


def _horovod_world_size():
    try:
        import horovod.tensorflow as hvd
        return hvd.size() if hvd.is_initialized() else 1
    except (ImportError, ValueError):
        return 1
