"""The compiled Program: what picasso_tf.compile makes of a model, and all that the
passes read and write. It holds GraphDefs and plain records, and creates no
TensorFlow state: the tables it names are created by the runtime's storage
(picasso_tf.embedding.storage) when a PicassoModel is built from it.

  graphs      "training" and "inference": CapturedGraphs (GraphDef, inputs, outputs,
              captures). A placeholder captured as a StorageRef reads a table of a
              group's storage; one captured as a tf.Variable reads the variable;
              for groups whose rows are fetched per step (row-sharded, hash-backed),
              FetchedRows and ExchangedIds placeholders take the fetched rows and ids.
  analyses    per graph, its embedding sites as captured (once K-packing has run, a
              graph's fused lookups are described by `lookups`, not by sites)
  statistics  ids per example and distinct-id shares (warm-up data or input shapes)
  frozen      names of the variables the model does not train (Keras' trainable=False
              layers keep trainable variables, so the model's own list decides)
  initializers  table name -> its Keras Embedding layer's initializer, serialized (a
              dynamic vocabulary draws its new keys' rows from it)
  tables      the TableLayouts: which original tables form a group, at which rows
  lookups     per graph, a LookupRecord for every fused lookup: what later passes
              (hybrid storage, sharding, interleaving) rewrite, found by record
  reports     per graph, the analysis and what each pass did
"""
import dataclasses
import zlib
from typing import Dict, FrozenSet, List, Optional

import tensorflow as tf

from picasso_tf.graph.analysis import Analysis
from picasso_tf.graph.capture import CapturedGraph


@dataclasses.dataclass
class TableMember:
    """One original table of a group."""
    variable: tf.Variable
    rows: int
    accesses: float          # ids looked up per example (warm-up statistics)

    @property
    def name(self):
        """The logical table's name: its variable's, which checkpoints key it by."""
        return self.variable.name.split(":")[0]


@dataclasses.dataclass
class TableLayout:
    """A group of same-dim tables that fused kernels read as one: D-packing's group."""
    name: str
    dim: int
    dtype: tf.DType
    members: List[TableMember]
    densely_read: bool = False    # some member table is also read whole: its gradient is dense
    trainable: bool = True        # False: frozen tables, packed apart, never updated
    kind: str = "tables"          # the storage kind (picasso_tf.embedding.storage.make_storage)
    hot_rows: int = 0             # hash-backed kind: rows its hot tier holds (picasso_tf.embedding.hot_tier)
    hot_bytes: int = 0            # and its share of hot_storage_bytes (fewer rows for more optimizer slots)

    @property
    def num_rows(self):
        return sum(m.rows for m in self.members)

    @property
    def param_volume(self):
        """The paper's Eq. 1 without its global factor N: sum over tables of
        dim x (ids looked up per example)."""
        return sum(self.dim * m.accesses for m in self.members)

    def member_of(self, variable):
        return next((m for m in self.members if m.variable is variable), None)

    def describe(self):
        return {"group": self.name, "dim": self.dim, "dtype": self.dtype.name, "rows": self.num_rows,
                "param_volume": round(self.param_volume, 3), "kind": self.kind, "hot_rows": self.hot_rows,
                "tables": [m.name for m in self.members]}


@dataclasses.dataclass(frozen=True)
class StorageRef:
    """A captured placeholder's value: what table group `group`'s storage hands the
    kernels for its member table number `member`."""
    group: str
    member: int


@dataclasses.dataclass(frozen=True)
class FetchedRows:
    """A captured placeholder's value: the rows of table group `group` that this step's
    batch looks up, fetched from the storage holding them (the ranks of hybrid
    parallelism, picasso_tf.distributed.exchange, or a hash table,
    picasso_tf.embedding.hybrid_hash); ExchangedIds index them."""
    group: str


@dataclasses.dataclass(frozen=True)
class ExchangedIds:
    """A captured placeholder's value: the ids that tensor `ids` of the graph looks up
    in member table `member` of group `group`, as positions in that group's FetchedRows."""
    group: str
    member: int
    ids: str            # the tensor of the graph holding the original ids
    feature: str        # for errors: the feature they belong to


@dataclasses.dataclass
class LookupRecord:
    """One fused lookup op of a graph."""
    node: str                     # the op's node name
    kind: str                     # packed | stitched | projection
    groups: List[str]             # the table groups it reads
    features: List[str]           # its sites' feature names
    replaces: List[str] = dataclasses.field(default_factory=list)  # concatenation / MatMul nodes


@dataclasses.dataclass
class Statistics:
    accesses: Dict[str, float]                 # table name -> ids per example
    distinct_ids: Dict[str, float]             # table name -> share of a batch's ids distinct (warm-up only)
    source: str                                # "input shapes" or "N warm-up batches"
    batch_size: Optional[float] = None         # examples per warm-up batch (warm-up only)


@dataclasses.dataclass
class Program:
    graphs: Dict[str, CapturedGraph]
    analyses: Dict[str, Analysis]
    statistics: Statistics
    frozen: FrozenSet[str] = frozenset()
    initializers: Dict[str, dict] = dataclasses.field(default_factory=dict)
    tables: Optional[List[TableLayout]] = None
    lookups: Dict[str, List[LookupRecord]] = dataclasses.field(default_factory=dict)
    reports: Dict[str, dict] = dataclasses.field(default_factory=dict)

    def table_of(self, variable):
        """(TableLayout, TableMember) holding an original table variable, else (None, None)."""
        for layout in self.tables or ():
            member = layout.member_of(variable)
            if member is not None:
                return layout, member
        return None, None

    def layout(self, name):
        return next(t for t in self.tables if t.name == name)

    def storage_refs(self):
        """The table groups some graph reads (each needs a storage)."""
        return sorted({v.group for g in self.graphs.values() for v in g.captures.values()
                       if isinstance(v, (StorageRef, FetchedRows))})

    def fingerprint(self):
        """A checksum of the rewritten graphs and table layouts (ranks compare theirs)."""
        digest = 0
        for name in sorted(self.graphs):
            digest = zlib.crc32(self.graphs[name].graph_def.SerializeToString(deterministic=True), digest)
        layouts = [(t.name, t.kind, [m.name for m in t.members]) for t in self.tables or ()]
        return zlib.crc32(repr(layouts).encode(), digest)

    def describe_tables(self):
        return [t.describe() for t in self.tables or ()]
