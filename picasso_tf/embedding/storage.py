"""The storage interface: where the state of a group of embedding tables lives.

A compiled Program (picasso_tf.program) names each group of tables by a TableLayout
and its fused kernels by a StorageRef; it creates no TensorFlow state. The Keras face
(picasso_tf.api) makes one storage per layout with ``make_storage`` and binds each
StorageRef to what that storage hands the kernels. Everything else about a group's
state goes through this interface:

  build            create the variables (from the original tables' current values)
  kernel_input     what a fused lookup reads (StorageRef placeholders are fed it)
  optimizer state  ``create_slots(row_sparse_optimizer)``, the rows' slot variables
  apply            a row-sparse update of unique rows (``apply``), or the update that
                   a gradient kernel applies in place (``in_place_update``)
  checkpoints      ``table_value(name)`` / ``assign_table(name, value)`` and the same
                   for slots: state by logical (original) table, whatever the plan
                   (picasso_tf.embedding.checkpoint builds the checkpoint from them)
  write_back       copy the rows into the original model's variables

Kinds plug in by ``STORAGE_KINDS``: "dense" (one variable stacking the group's tables
by rows) is the first. A hash-backed kind (HybridHash: a hot tier plus a DRAM hash
map) keeps this interface with a resource instead of a variable as kernel input; a
row-sharded kind (Horovod model parallelism) holds this rank's shard of either kind
and answers ``table_value`` for the rows it owns. The passes choose a layout's kind
(``TableLayout.kind``); they never create its state.
"""
import tensorflow as tf


class EmbeddingStorage:
    """The state of one TableLayout (see the module docstring)."""

    def __init__(self, layout):
        self.layout = layout
        self.slots = {}            # slot name -> variable, once create_slots ran

    @property
    def name(self):
        return self.layout.name

    def kernel_input(self):
        raise NotImplementedError

    def create_slots(self, optimizer):
        raise NotImplementedError

    def apply(self, optimizer, rows, row_grads, iteration, apply_weight_decay):
        raise NotImplementedError

    def in_place_update(self, optimizer, iteration, apply_weight_decay):
        raise NotImplementedError

    def table_value(self, member, slot=None):
        raise NotImplementedError

    def assign_table(self, member, value, slot=None):
        raise NotImplementedError

    def write_back(self):
        for member in self.layout.members:
            member.variable.assign(self.table_value(member))


class DenseStorage(EmbeddingStorage):
    """One variable [rows, dim] holding the group's tables stacked at their offsets;
    slots of the same shape. Initial rows are the original tables' current values,
    so step 0 equals the plain model's."""

    kind = "dense"

    def __init__(self, layout):
        super().__init__(layout)
        with tf.init_scope():
            initial = tf.concat([m.variable.read_value() for m in layout.members], axis=0)
            # D-packing groups frozen tables apart, so a group trains as its members do.
            self.variable = tf.Variable(initial, name=f"picasso/{layout.name}", dtype=layout.dtype,
                                        trainable=layout.trainable)

    def kernel_input(self):
        return self.variable

    def create_slots(self, optimizer):
        # The same slots serve every optimizer of the same kind (a profile's copy, say).
        if set(self.slots) != set(optimizer.slot_names):
            self.slots = optimizer.create_slots(self.variable, f"picasso/{self.name}")
        return self.slots

    def apply(self, optimizer, rows, row_grads, iteration, apply_weight_decay):
        return optimizer.apply(self.variable, self.slots, rows, row_grads, iteration,
                               apply_weight_decay=apply_weight_decay)

    def in_place_update(self, optimizer, iteration, apply_weight_decay):
        return optimizer.update(self.variable, self.slots, iteration, apply_weight_decay=apply_weight_decay)

    def _holder(self, slot):
        if slot is None:
            return self.variable
        if slot not in self.slots:
            raise KeyError(f"packed group {self.name} has no optimizer slot {slot!r} (it has {sorted(self.slots)})")
        return self.slots[slot]

    def table_value(self, member, slot=None):
        return self._holder(slot)[member.offset:member.offset + member.rows]

    def assign_table(self, member, value, slot=None):
        holder = self._holder(slot)
        value = tf.convert_to_tensor(value, dtype=holder.dtype)
        expected = [member.rows, self.layout.dim]
        if value.shape.as_list() != expected:
            raise ValueError(f"embedding table {member.name}: a value of shape {value.shape.as_list()} does not fit "
                             f"the table's {expected}" + (f" (optimizer slot {slot!r})" if slot else ""))
        return holder[member.offset:member.offset + member.rows].assign(value)


STORAGE_KINDS = {"dense": DenseStorage}


def make_storage(layout):
    """The storage of a TableLayout, of the kind the passes chose."""
    if layout.kind not in STORAGE_KINDS:
        raise ValueError(f"packed group {layout.name}: unknown storage kind {layout.kind!r}; "
                         f"the kinds are {sorted(STORAGE_KINDS)}")
    return STORAGE_KINDS[layout.kind](layout)
