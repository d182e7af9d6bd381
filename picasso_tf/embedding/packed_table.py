"""PackedTable: one variable holding a packed group's tables stacked by rows.

Initial values are copied from the original tables, so step 0 equals the baseline
exactly; write_back() copies the rows back into the original (unpacked) variables,
e.g. to serve or export with the user's own model.
"""
import tensorflow as tf


class PackedTable:
    def __init__(self, group):
        self.group = group
        with tf.init_scope():
            initial = tf.concat([s.variable.read_value() for s in group.slots], axis=0)
            self.variable = tf.Variable(initial, name=f"picasso/{group.name}", dtype=group.dtype)

    @property
    def name(self):
        return self.group.name

    def write_back(self):
        """Assigns each original table its rows of the packed table."""
        value = self.variable.read_value()
        for slot in self.group.slots:
            slot.variable.assign(value[slot.offset:slot.offset + slot.rows])

    def read_back(self):
        """The inverse of write_back: reload the packed rows from the original tables."""
        self.variable.assign(tf.concat([s.variable.read_value() for s in self.group.slots], axis=0))
