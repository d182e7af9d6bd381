"""Checkpoints of table groups by logical (original) table, whatever the plan.

A PicassoModel tracks one LogicalTables object; under it each original table has a
node named by the table's path in the original model's checkpoints (e.g.
`layer_with_weights-0/embeddings`, stable across instances of the same architecture,
unlike Keras' generated variable names), with a `value` child and, once the optimizer's
slots exist, one child per slot (Keras' slot names: `accumulator`, `m`, `v`, ...).
Each child saves and restores that table's rows of its storage, so a checkpoint
restores into a model planned differently (other warm-up statistics, shards,
max_shards, packing off), and a table whose shape does not fit raises an error naming
it. Slot children appear when the storage's slots are made (the first training step);
a checkpoint read before that is restored into them then, as Keras restores its own
optimizer's slots.
"""
from tensorflow.python.checkpoint import graph_view
from tensorflow.python.checkpoint import util as checkpoint_util
from tensorflow.python.trackable import base as trackable_base

VALUE = "value"


class TableState(trackable_base.Trackable):
    """One table's rows of a storage variable: its value, or one optimizer slot."""

    def __init__(self, storage, member, slot=None):
        self._storage, self._member, self._slot = storage, member, slot

    def _serialize_to_tensors(self):
        return {trackable_base.VARIABLE_VALUE_KEY: self._storage.table_value(self._member, self._slot)}

    def _restore_from_tensors(self, restored_tensors):
        return self._storage.assign_table(self._member, restored_tensors[trackable_base.VARIABLE_VALUE_KEY],
                                          self._slot)


class LogicalTable(trackable_base.Trackable):
    """A logical table's node: its value and its slots."""

    def __init__(self, storage, member):
        self._storage, self._member = storage, member
        self._track_trackable(TableState(storage, member), VALUE)

    def track_slots(self):
        for slot in sorted(self._storage.slots):
            if self._lookup_dependency(slot) is None:
                self._track_trackable(TableState(self._storage, self._member, slot), slot)


class LogicalTables(trackable_base.Trackable):
    """Every table of every storage, by the table's path in `original`."""

    def __init__(self, storages, original):
        paths = object_paths(original)
        self._tables = []
        for storage in storages:
            for member in storage.layout.members:
                table = LogicalTable(storage, member)
                self._tables.append(table)
                self._track_trackable(table, paths.get(member.variable.ref(), member.name))

    def track_slots(self):
        """Adds the slots' nodes (restoring any a checkpoint read earlier holds)."""
        for table in self._tables:
            table.track_slots()


def object_paths(root):
    """{variable.ref(): its path in root's checkpoints} for every variable under root."""
    node_paths = checkpoint_util.objects_ids_and_slot_variables_and_paths(graph_view.ObjectGraphView(root))[1]
    return {obj.ref(): "/".join(ref.name for ref in path) for obj, path in node_paths.items()
            if hasattr(obj, "ref") and hasattr(obj, "handle")}
