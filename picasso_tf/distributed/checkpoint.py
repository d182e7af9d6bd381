"""Checkpoints of a model whose tables are row-sharded over the ranks, written without
gathering a table: every rank writes its blocks of the tables and their optimizer slots
(slices of the logical tables, under the original variables' keys) to a part file
beside the checkpoint, rank 0 writes the rest (the dense part is the same on every
rank) with the object graph, and rank 0 merges the parts into one checkpoint: the
plain model's, with the tables stored as slices, which TensorFlow reads whole or by any
other slicing (picasso_tf.embedding.sharded restores each rank's block of it). The
ranks must share the checkpoint's directory (one machine, or a shared file system).

State gathered from every rank by write_back (a collective) cannot be gathered while
TensorFlow serializes a checkpoint, which it also does to restore one (for the names
and dtypes): ``refused_on_save`` gives a restore what it asks for, and a save an error.
With such specs TensorFlow restores inside a function: ``restore_with_numpy`` takes the
values there as eagerly.
"""
import os

import numpy as np
import tensorflow as tf
from tensorflow.python.checkpoint import graph_view, util
from tensorflow.python.ops import gen_io_ops, io_ops
from tensorflow.python.trackable import base as trackable, trackable_utils
from tensorflow.python.training.saving.saveable_object import SaveSpec

from picasso_tf.distributed.world import mean_over_ranks, min_over_ranks


def save_sharded_weights(model, filepath, shards, world, options=None):
    """Writes model's checkpoint to `filepath` (TensorFlow's format) from every rank;
    `shards` are this rank's picasso_tf.embedding.sharded.Shard. Every rank calls it."""
    filepath = os.fspath(filepath)
    part = f"{filepath}.picasso-part-{world.rank}-of-{world.size}"
    state, error = _WROTE, None
    try:
        tf.io.gfile.makedirs(os.path.dirname(filepath) or ".")     # whichever rank comes first
        if world.rank == 0:
            tf.train.Checkpoint(root=model).write(part, options=options)
        else:
            names = util.objects_ids_and_slot_variables_and_paths(graph_view.ObjectGraphView(model))[4]
            entries = [(trackable_utils.checkpoint_key(names[s.original], trackable.VARIABLE_VALUE_KEY), s.slice_spec,
                        s.rows()) for s in shards if s.held and s.original in names]
            if entries:
                keys, specs, tensors = zip(*entries)
                io_ops.save_v2(part, list(keys), list(specs), list(tensors))
            else:
                state = _NOTHING    # it holds no row of any table
    except Exception as e:      # the other ranks must not wait for this one's part
        tf.get_logger().error(f"picasso_tf: rank {world.rank} could not write its part of {filepath!r}: {e}")
        state, error = _FAILED, e
    states = np.zeros(world.size)
    states[world.rank] = state
    states = np.rint(mean_over_ranks(states) * world.size)
    if (states == _FAILED).any():
        raise error if state == _FAILED else RuntimeError(
            f"picasso_tf: save_weights({filepath!r}): ranks {np.flatnonzero(states == _FAILED).tolist()} could not "
            "write their parts of the checkpoint (their logs say why)")
    error = None
    if world.rank == 0:
        try:
            parts = [f"{filepath}.picasso-part-{r}-of-{world.size}" for r in range(world.size) if states[r] == _WROTE]
            missing = [p for p in parts if not tf.io.gfile.exists(p + ".index")]
            if missing:
                raise FileNotFoundError(
                    f"picasso_tf: save_weights under hybrid parallelism: rank 0 does not see the parts {missing} "
                    "the other ranks wrote; save to a directory every rank shares (a shared file system)")
            gen_io_ops.merge_v2_checkpoints(parts, filepath, delete_old_dirs=False)    # deletes the parts
            # As keras.Model.save_weights does: tf.train.latest_checkpoint finds it.
            tf.__internal__.train.update_checkpoint_state(save_dir=os.path.dirname(filepath),
                                                          model_checkpoint_path=filepath, save_relative_paths=True,
                                                          all_model_checkpoint_paths=[filepath])
        except Exception as e:
            error = e
    if min_over_ranks(int(error is None), "picasso_checkpoint_merged") == 0:
        raise error if error is not None else RuntimeError(
            f"picasso_tf: save_weights({filepath!r}): rank 0 could not merge the ranks' parts (its log says why)")


def refused_on_save(dtypes, refuse):
    """A trackable's _serialize_to_tensors for state that is not current on this rank:
    {name: dtype} as SaveSpecs whose tensor is only computed by a save, which calls
    `refuse` (which raises, naming what to do)."""
    return {name: SaveSpec(refuse, "", name, dtype=dtype, device="/cpu:0") for name, dtype in dtypes.items()}


def restore_with_numpy(restore, tensors):
    """A trackable's _restore_from_tensors that runs restore(*NumPy arrays) of `tensors`:
    now when eager, else as the function TensorFlow restores in (a checkpoint whose
    tensors lie on several devices) runs; returns the op."""
    if tf.executing_eagerly():
        restore(*[t.numpy() for t in tensors])
        return tf.no_op()
    return tf.py_function(lambda *values: restore(*[v.numpy() for v in values]), tensors, [])


_FAILED, _NOTHING, _WROTE = -1, 0, 1
