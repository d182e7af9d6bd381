"""The pass manager: runs the enabled passes in order and collects their reports.

A pass is a function (RewriteState, Config) -> (RewriteState, report dict). The state
carries the captured graph (GraphDef, inputs, outputs, captures), its analysis and the
RewritePlan shared between the training and the inference graph.
"""
import dataclasses
import time

from picasso_tf.config import PASS_ORDER
from picasso_tf.graph.analysis import Analysis, find_embedding_sites
from picasso_tf.graph.capture import CapturedGraph
from picasso_tf.passes.d_packing import d_packing
from picasso_tf.passes.interactions import interactions
from picasso_tf.passes.k_packing import k_packing
from picasso_tf.passes.later import distribute, hybrid_hash, k_interleave
from picasso_tf.passes.plan import RewritePlan

PASSES = {"d_packing": d_packing, "k_packing": k_packing, "interactions": interactions, "hybrid_hash": hybrid_hash,
          "distribute": distribute, "k_interleave": k_interleave}
assert tuple(PASSES) == PASS_ORDER


@dataclasses.dataclass
class RewriteState:
    graph: CapturedGraph
    analysis: Analysis
    plan: RewritePlan


def run_passes(captured, plan, config):
    """Rewrites one captured graph; returns (CapturedGraph, report)."""
    state = RewriteState(captured, find_embedding_sites(captured), plan)
    report = {"graph": "training" if captured.training else "inference",
              "analysis": state.analysis.report(), "passes": []}
    for name in PASS_ORDER:
        if not config.pass_enabled(name):
            report["passes"].append({"pass": name, "enabled": False})
            continue
        start = time.perf_counter()
        state, pass_report = PASSES[name](state, config)
        report["passes"].append({"pass": name, "enabled": True,
                                 "seconds": round(time.perf_counter() - start, 4), **pass_report})
    return state.graph, report
