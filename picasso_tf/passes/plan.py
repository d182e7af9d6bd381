"""RewritePlan: what the passes decided, shared by the training and inference graphs.

Tables are keyed by variable (not by graph names), so the plan made on the training
graph applies unchanged to the inference graph.
"""
import dataclasses
from typing import Dict, List, Optional

import tensorflow as tf


@dataclasses.dataclass
class TableSlot:
    """One original table inside a packed group: rows [offset, offset + rows)."""
    variable: tf.Variable
    offset: int
    rows: int
    accesses: float          # ids looked up per example (warm-up statistics)


@dataclasses.dataclass
class PackedGroup:
    name: str
    dim: int
    dtype: tf.DType
    slots: List[TableSlot]
    densely_read: bool = False    # some member table is also read whole: its gradient is dense

    @property
    def num_rows(self):
        return sum(s.rows for s in self.slots)

    @property
    def param_volume(self):
        """The paper's Eq. 1 without its global factor N: sum over tables of
        dim x (ids looked up per example)."""
        return sum(self.dim * s.accesses for s in self.slots)

    def slot_of(self, variable):
        for s in self.slots:
            if s.variable is variable:
                return s
        return None


@dataclasses.dataclass
class RewritePlan:
    groups: Optional[List[PackedGroup]] = None
    accesses: Dict[str, float] = dataclasses.field(default_factory=dict)  # table name -> ids/example
    # table name -> share of a batch's ids distinct within their site (warm-up data only)
    distinct_ids: Dict[str, float] = dataclasses.field(default_factory=dict)
    statistics_source: str = "input shapes"
    packed_tables: Dict[str, object] = dataclasses.field(default_factory=dict)  # group name -> PackedTable

    def group_of(self, variable):
        for g in self.groups or ():
            slot = g.slot_of(variable)
            if slot is not None:
                return g, slot
        return None, None

    def describe(self):
        return [{"group": g.name, "dim": g.dim, "dtype": g.dtype.name, "rows": g.num_rows,
                 "param_volume": round(g.param_volume, 3),
                 "tables": [s.variable.name.split(":")[0] for s in g.slots]} for g in self.groups or ()]
