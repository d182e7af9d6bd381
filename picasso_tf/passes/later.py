"""The pass slot whose technique has not landed yet: caching (HybridHash). It runs in its
place in the pipeline; asking for behaviour that does not exist yet is an error, never
a silent no-op."""


def hybrid_hash(program, graph, config):
    raise NotImplementedError(
        "picasso_tf: the HybridHash embedding (hybrid_hash=True) is not built yet; "
        "run with hybrid_hash=False (the default)")
