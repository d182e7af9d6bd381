"""The storage interface: where the state of a group of embedding tables lives.

A compiled Program (picasso_tf.program) names each group of tables by a TableLayout
and each table a fused kernel reads by a StorageRef(group, member); it creates no
TensorFlow state. The Keras face (picasso_tf.api) makes one storage per layout with
``make_storage`` and binds each StorageRef to what that storage hands the kernels.
Everything else about a group's state goes through this interface:

  kernel_inputs    per member table, what a fused lookup reads (StorageRef
                   placeholders are fed it)
  variables        per member table, the variable its gradient is taken for
  optimizer state  ``slots(optimizer, member)``: the member's slot variables
  apply            a step's update (sparse_apply.Update) of unique rows; a gradient
                   kernel may instead apply it in place, to ``variables``
  write_back       make the original model's variables hold the rows (checkpoints, export)
  release          free what write_back gathered into the originals (where that is a copy)
  read_back        make the storage hold the original variables' rows (after a restore)
  checkpoint_children  state beyond the original variables' that checkpoints save, as
                   {name derived from a logical table's name: trackable}; the model's
                   checkpoint lists them beside the plain model's objects

Kinds plug in at ``make_storage``. "tables" is the first: the group's original
tables read in place, with the Keras optimizer's own slot variables, so a wrapped
model holds every row once and checkpoints exactly as the plain model does.
"sharded" (picasso_tf.embedding.sharded, hybrid parallelism) holds this rank's rows
and serves the other ranks' lookups through the step's exchange. "hybrid_hash"
(picasso_tf.embedding.hybrid_hash) holds the rows in a hash table keyed by id: the
step fetches the batch's rows from it and updates them with ``apply_fetched``;
"dynamic_vocabulary" (picasso_tf.embedding.dynamic_vocabulary) does the same with hash
tables keyed by raw id. Kinds whose state is not the original variables keep the
checkpoint the plain model's through the original variables (they write their rows
back into them before a save and read them back after a restore), except the dynamic
vocabulary, whose keys no original table has: its rows are checkpointed under names of
their own (``checkpoint_children``). The passes choose a layout's kind
(``TableLayout.kind``); they never create its state.
"""
import tensorflow as tf

from picasso_tf.ops import sparse_apply


class EmbeddingStorage:
    """The state of one TableLayout (see the module docstring)."""

    collective = False      # write_back and read_back are collectives: every rank calls them together

    def __init__(self, layout):
        self.layout = layout

    @property
    def name(self):
        return self.layout.name

    def kernel_inputs(self):
        raise NotImplementedError

    def variables(self):
        raise NotImplementedError

    def slots(self, optimizer, member):
        raise NotImplementedError

    def apply(self, optimizer, member, rows, row_grads, update):
        raise NotImplementedError

    def write_back(self):
        raise NotImplementedError

    def release(self):
        """Frees the originals' copy of the rows that write_back made, where the
        storage's own state holds them (row-sharded tables); nothing to do elsewhere."""

    def read_back(self):
        raise NotImplementedError

    def check_read_back(self):
        """Refuses, changing nothing, what a restore read that read_back cannot take (every
        storage checks before any reads back); nothing to refuse by default."""

    def checkpoint_children(self):
        return {}


class TablesInPlace(EmbeddingStorage):
    """The group's original tables themselves: the fused kernels read them as a list
    and the fused updates write their rows, with the Keras optimizer's slot variables
    for each (picasso_tf.embedding.row_sparse_optimizers). Nothing is copied."""

    kind = "tables"

    def kernel_inputs(self):
        return [m.variable for m in self.layout.members]

    def variables(self):
        return self.kernel_inputs()

    def slots(self, optimizer, member):
        return optimizer.keras_slots(member.variable)

    def apply(self, optimizer, member, rows, row_grads, update):
        return sparse_apply.apply(member.variable, rows, row_grads, update, lazy=optimizer.lazy)

    def write_back(self):
        pass   # the original variables are the state

    def read_back(self):
        pass


def make_storage(layout, world, config, initializers=None):
    """The storage of a TableLayout, of the kind the passes chose, for this rank of
    `world`, with the options of `config` (a picasso_tf.Config); `initializers`: table name
    -> its layer's serialized Keras initializer (Program.initializers), for kinds that make
    new rows."""
    from picasso_tf.embedding.dynamic_vocabulary import DynamicVocabularyTables, VocabularyOptions
    from picasso_tf.embedding.hot_tier import tier_device
    from picasso_tf.embedding.hybrid_hash import HybridHashTables   # they build on this module
    from picasso_tf.embedding.sharded import RowShardedTables
    if layout.kind == TablesInPlace.kind:
        return TablesInPlace(layout)
    if layout.kind == RowShardedTables.kind:
        return RowShardedTables(layout, world)
    if layout.kind in (HybridHashTables.kind, HybridHashTables.sharded_kind):
        return HybridHashTables(layout, config.hot_warmup_steps, config.hot_refresh_every, world,
                                config.hot_refresh, tier_device(config.hot_tier_device))
    if layout.kind == DynamicVocabularyTables.kind:
        return DynamicVocabularyTables(layout, [tf.keras.initializers.deserialize(initializers[m.name])
                                                for m in layout.members], VocabularyOptions.from_config(config), world)
    kinds = [TablesInPlace.kind, RowShardedTables.kind, HybridHashTables.kind, HybridHashTables.sharded_kind,
             DynamicVocabularyTables.kind]
    raise ValueError(f"packed group {layout.name}: unknown storage kind {layout.kind!r}; the kinds are {kinds}")
