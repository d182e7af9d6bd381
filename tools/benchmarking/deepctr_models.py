"""The deepctr section of picasso-bench: DeepCTR's models (deepctr 0.9.4, models written by
others) at their default configurations, regularisers included, on the criteo-like data of
the zoo section, each at every batch size of the mode: stock Keras vs picasso_tf vs the
dense-only bound, timed interleaved like the zoo's cells.

Feature columns: a SparseFeat per categorical field (deepctr_vocab rows, dim 8, the data's
id dtype) and a DenseFeat per dense one. DeepCTR models take them as (linear, dnn)
columns, all features in both, except where the model refuses that (COLUMNS).
"""
import contextlib
import io
import math

from picasso_tf.tools.benchmarking import sections

MODELS = ("WDL", "DeepFM", "NFM", "PNN", "DCN", "DCNMix", "xDeepFM", "AutoInt", "FiBiNET", "AFM", "CCPM",
          "FLEN", "FwFM", "ONN", "IFM", "DIFM", "EDCN", "FNN", "MLR", "DeepFEFM")
EMBEDDING_DIM = 8
FLEN_GROUPS = 3

# The columns a model is called with, where not (all, all): PNN and MLR take one list;
# AFM and CCPM refuse DenseFeat among the dnn columns; EDCN builds its inputs from the dnn
# columns alone, so its linear part cannot take the dense features either.
COLUMNS = {"PNN": ("all",), "MLR": ("all",), "AFM": ("all", "sparse"), "CCPM": ("all", "sparse"),
           "EDCN": ("sparse", "sparse")}


def feature_columns(schema, vocab, groups=None):
    """{"sparse": [SparseFeat], "all": sparse + [DenseFeat]} of the schema; `groups`: FLEN's
    field groups, the categorical fields split into that many runs (criteo's fields have
    no user / item / context meaning to group them by)."""
    from deepctr.feature_column import DenseFeat, SparseFeat
    categorical = schema.categorical
    sparse = []
    for i, f in enumerate(categorical):
        group = {"group_name": f"group{i * groups // len(categorical)}"} if groups else {}
        sparse.append(SparseFeat(f.name, vocab, embedding_dim=EMBEDDING_DIM, dtype=f.dtype, **group))
    return {"sparse": sparse, "all": sparse + [DenseFeat(f.name, f.dim) for f in schema.dense]}


def build(name, schema, vocab):
    """DeepCTR's model `name` at its default hyper-parameters on the schema."""
    import deepctr.models
    columns = feature_columns(schema, vocab, FLEN_GROUPS if name == "FLEN" else None)
    with contextlib.redirect_stdout(io.StringIO()):       # some models print their settings
        model = getattr(deepctr.models, name)(*(columns[c] for c in COLUMNS.get(name, ("all", "all"))))
    # DeepCTR names its output after its last layer; the suite keys labels by output name.
    model.output_names = list(schema.labels)
    return model


def run(sizes, progress):
    out = {"title": "DeepCTR models (issue 38)", "rows": [], "notes": [], "batch_sizes": list(sizes.deepctr_batches)}
    try:
        import deepctr.models
    except ImportError as e:
        out["notes"].append(f"{sections.NOT_BUILT}: deepctr cannot be imported ({e})")
        return out
    names = sizes.deepctr_models or MODELS
    progress("deepctr: generating data")
    data = sections.criteo_data(sizes, max(sizes.deepctr_batches) * sizes.batches, sizes.deepctr_vocab - 1)
    for batch in sizes.deepctr_batches:
        for name in names:
            progress(f"deepctr {name} @{batch}: building")
            try:
                trio, _ = sections.build_trio(lambda name=name: build(name, data.schema, sizes.deepctr_vocab), data,
                                              batch, "adagrad", sizes)
                row = sections._timed_row(f"{name}@{batch}", trio, sizes, progress, rounds=sizes.zoo_rounds,
                                          steps=sizes.zoo_steps, model=name, batch_size=batch)
                del trio
            except Exception as e:   # noqa: BLE001  (recorded in the row)
                row = {"name": f"{name}@{batch}", "model": name, "batch_size": batch, "error": sections._error(e)}
            out["rows"].append(row)
            sections.cleanup()
    out["summary"] = geometric_means(out["rows"])
    out["notes"].append(
        f"DeepCTR {deepctr.__version__} models at their default hyper-parameters (regularisers included: the "
        f"embeddings' L2 reads every table whole each step), on the criteo-like preset (26 fields, ids < "
        f"{sizes.deepctr_vocab:,}, + 13 dense): SparseFeat vocabulary {sizes.deepctr_vocab:,}, dim "
        f"{EMBEDDING_DIM}; DenseFeat dim 1. Columns (linear, dnn) = (all, all) except PNN and MLR (one list), "
        "AFM and CCPM (dnn: sparse only; they refuse DenseFeat there), EDCN (sparse only: it builds its inputs "
        f"from the dnn columns); FLEN's field groups are the 26 fields in {FLEN_GROUPS} runs. Adagrad(0.01) for "
        "all. The bound drops the embeddings' regularisers with the embedding layers.")
    return out


def geometric_means(rows):
    """{batch size: {"geomean", "min", "max", "cells"}} of picasso/baseline over the rows
    that have the ratio."""
    by_batch = {}
    for row in rows:
        ratio = row.get("ratios", {}).get("picasso/baseline")
        if ratio:
            by_batch.setdefault(row["batch_size"], []).append(ratio["median"])
    return {str(batch): {"geomean": math.exp(sum(map(math.log, r)) / len(r)), "min": min(r), "max": max(r),
                         "cells": len(r)} for batch, r in by_batch.items()}
