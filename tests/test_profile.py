"""The profiler: op counts equal a hand count, and the artefacts a user opens exist."""
import json

import numpy as np
import tensorflow as tf

import picasso_tf as picasso
from picasso_tf.profiling.op_counts import count_ops, summarize
from picasso_tf.tools import profile_graph


def test_counts_equal_a_hand_count():
    fn = tf.function(lambda x: tf.matmul(x, x) + 1.0)
    graph_def = fn.get_concrete_function(tf.TensorSpec([2, 2], tf.float32)).graph.as_graph_def()
    # Placeholder x, MatMul, Const 1.0, AddV2, Identity (the function's return value).
    assert count_ops(graph_def) == {"Placeholder": 1, "MatMul": 1, "Const": 1, "AddV2": 1, "Identity": 1}
    summary = summarize(count_ops(graph_def))
    assert summary["total"] == 4 and summary["arguments"] == 1    # x is an argument, not an op
    assert summary["by_class"] == {"compute": 2, "memory": 0, "communication": 0, "other": 2}


def test_counts_include_control_flow_bodies():
    fn = tf.function(lambda n: tf.while_loop(lambda i: i < n, lambda i: i + 1, [0]))
    graph_def = fn.get_concrete_function(tf.TensorSpec([], tf.int32)).graph.as_graph_def()
    top_level = {n.op for n in graph_def.node}
    assert "Less" not in top_level and "AddV2" not in top_level    # they live in the loop's functions
    counts = count_ops(graph_def)
    assert counts["Less"] == 1 and counts["AddV2"] == 2            # i + 1 and while_v2's loop counter


def test_profile_reports_before_and_after_and_writes_artefacts(tmp_path):
    inputs = {f"f{i}": tf.keras.Input((), dtype="int64", name=f"f{i}") for i in range(6)}
    embs = [tf.keras.layers.Embedding(30, 4 if i % 2 else 8)(inputs[f"f{i}"]) for i in range(6)]
    model = picasso.optimize(tf.keras.Model(inputs, tf.keras.layers.Dense(1, activation="sigmoid")(
        tf.keras.layers.Concatenate()(embs))), shard_heavy_groups=False)
    model.compile(optimizer="adagrad", loss="binary_crossentropy")
    rng = np.random.default_rng(0)
    batch = ({f"f{i}": rng.integers(0, 30, 16) for i in range(6)}, np.zeros(16, np.float32))
    before = [v.numpy() for v in model.original.weights]
    report = picasso.profile(model, batch, out_dir=str(tmp_path), trace_steps=2)
    ops = report["ops"]
    assert ops["forward_baseline"]["by_op"]["ResourceGather"] == 6
    assert "ResourceGather" not in ops["forward_picasso"]["by_op"]
    # Both packed groups' lookups are stitched into the model's concatenation, which
    # only feeds the Dense(1): one op computes the Dense's product from the rows.
    assert ops["forward_picasso"]["by_op"]["PicassoStitchedProjection"] == 1
    assert "MatMul" not in ops["forward_picasso"]["by_op"]
    assert "ConcatV2" not in ops["forward_picasso"]["by_op"] and report["packed_groups"] == 2
    assert report["embedding_sites"] == 6
    assert ops["step_picasso"]["total"] < ops["step_baseline"]["total"]
    for name in ("forward_baseline", "forward_picasso", "step_baseline", "step_picasso"):
        assert (tmp_path / f"{name}.pbtxt").stat().st_size > 0
        assert any((tmp_path / "tensorboard" / name).iterdir())
    assert any((tmp_path / "tensorboard" / "trace").rglob("*.xplane.pb"))
    assert json.loads((tmp_path / "profile.json").read_text())["packed_groups"] == 2
    assert "training-step ops after/before" in (tmp_path / "profile.txt").read_text()
    for b, a in zip(before, model.original.weights):          # profiling trains nothing
        np.testing.assert_array_equal(b, a.numpy())


def test_profile_graph_tool(tmp_path, capsys):
    assert profile_graph.main(["--model", "lr", "--data", "criteo", "--batch-size", "64", "--trace-steps", "0",
                               "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "training-step ops after/before" in out and (tmp_path / "step_picasso.pbtxt").exists()
    assert profile_graph.main(["--model", "nope", "--out", str(tmp_path)]) == 2


def test_breakdown_times_each_kernel_by_its_node():
    """tools/benchmarking/breakdown.py: a traced fit's kernels, by op type and by the node
    each ran (the step's fused lookup and its gradient among them), the input pipeline's
    marked as such."""
    from picasso_tf.tools.benchmarking.breakdown import op_breakdown
    ids = tf.keras.Input((3,), dtype=tf.int64)
    logit = tf.keras.layers.Dense(1)(tf.keras.layers.Flatten()(tf.keras.layers.Embedding(100, 4)(ids)))
    model = picasso.optimize(tf.keras.Model(ids, logit))
    model.compile("adagrad", "mse")
    rng = np.random.default_rng(0)
    data = tf.data.Dataset.from_tensor_slices((rng.integers(0, 100, (640, 3)), rng.random((640, 1)))).batch(64)
    data = data.map(lambda x, y: (x + 0, y)).repeat()
    model.fit(data, steps_per_epoch=3, verbose=0)
    result = op_breakdown(model, data, steps=3, top=1000)
    nodes = {e["node"]: e["op"] for e in result["by_node"]}
    lookups = [n for n, op in nodes.items() if op == "PicassoPackedLookup"]
    assert len(lookups) == 1 and lookups[0].endswith("/PicassoPackedLookup") and "/picasso/" in lookups[0]
    assert any(op.startswith("PicassoPackedLookupGrad") and n.startswith("gradients/") for n, op in nodes.items())
    assert any(n.startswith("tf.data: ") for n in nodes)                    # the map's AddV2
    assert not any(op.startswith("Iterator::") for op in nodes.values())    # spans, not kernels
    assert sum(e["ops_per_step"] for e in result["by_type"] if e["op"] == "PicassoPackedLookup") == 1
