"""The pass manager: runs the enabled passes in order over every graph of a Program.

A pass is a plain function (program, graph name, config) -> (program, report): it
returns a Program whose graph of that name is rewritten, and a dict saying what it did.
It creates no TensorFlow state (a variable made inside a pass is an error: state
belongs to the storage the runtime builds from the Program's table layouts), and the
Program it leaves must be valid for the next pass (checked after each).
"""
import time

import tensorflow as tf

from picasso_tf.passes.d_packing import d_packing
from picasso_tf.passes.dense_packing import dense_packing
from picasso_tf.passes.dynamic_vocabulary import dynamic_vocabulary
from picasso_tf.passes.interactions import interactions
from picasso_tf.passes.k_packing import k_packing
from picasso_tf.passes.distribute import distribute
from picasso_tf.passes.hybrid_hash import hybrid_hash
from picasso_tf.passes.interleaving import k_interleave
from picasso_tf.program import StorageRef

# In the order they run (ARCHITECTURE.md §2).
PASSES = (("d_packing", d_packing), ("k_packing", k_packing), ("interactions", interactions),
          ("dense_packing", dense_packing),
          ("dynamic_vocabulary", dynamic_vocabulary), ("hybrid_hash", hybrid_hash), ("distribute", distribute), ("k_interleave", k_interleave))


class PassCreatedStateError(RuntimeError):
    """A pass tried to create a tf.Variable."""


def run_passes(program, config):
    """Rewrites every graph of `program`; returns the new Program, its reports filled."""
    for name in program.graphs:
        program.reports[name] = {"graph": name, "analysis": program.analyses[name].report(), "passes": []}
    for pass_name, rewrite in PASSES:
        for name in list(program.graphs):
            if not config.pass_enabled(pass_name):
                program.reports[name]["passes"].append({"pass": pass_name, "enabled": False})
                continue
            start = time.perf_counter()
            with tf.variable_creator_scope(_refuse_variables(pass_name)):
                program, report = rewrite(program, name, config)
            check_program(program, f"after {pass_name}")
            program.reports[name]["passes"].append({"pass": pass_name, "enabled": True,
                                                    "seconds": round(time.perf_counter() - start, 4), **report})
    return program


def _refuse_variables(pass_name):
    def creator(next_creator, **kwargs):
        raise PassCreatedStateError(
            f"picasso_tf: pass {pass_name} tried to create a variable ({kwargs.get('name')}); passes "
            "describe state by TableLayouts and StorageRefs, and the runtime's storage creates it")
    return creator


def check_program(program, when):
    """Every placeholder of every graph is an input or a capture, every StorageRef names
    a table layout, and every output is in the graph."""
    layouts = {t.name for t in program.tables or ()}
    for name, graph in program.graphs.items():
        nodes = {n.name: n for n in graph.graph_def.node}
        fed = {t.split(":")[0] for t in list(graph.input_tensors) + list(graph.captures)}
        loose = [n for n, node in nodes.items() if node.op == "Placeholder" and n not in fed]
        missing = [t for t in graph.output_tensors + graph.mask_tensors if t.split(":")[0] not in nodes]
        unknown = sorted({v.group for v in graph.captures.values() if isinstance(v, StorageRef)} - layouts)
        if loose or missing or unknown:
            raise AssertionError(f"picasso_tf: the {name} graph is broken {when}: placeholders fed by nothing "
                                 f"{loose[:5]}, outputs not in the graph {missing[:5]}, storage of unknown "
                                 f"groups {unknown}; please report this model")
