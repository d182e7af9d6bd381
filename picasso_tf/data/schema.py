"""Feature schema: what each input feature is, shared by readers, generators and models.

Conventions every reader, generator and zoo model follows:
  * dense features are float32 of shape [batch] (or [batch, dim] when dim > 1);
  * one-hot categorical features are int64 of shape [batch];
  * multi-hot / sequence features are int64 of shape [batch, max_len], right-padded;
  * id 0 of every categorical feature means "missing / padding", so real ids lie in
    [1, vocab_size) and a sequence's padding can be masked with `ids != 0`;
  * labels are float32 of shape [batch]; several labels (multi-task) come as a dict.
"""
import dataclasses
import json
from typing import List, Optional

import tensorflow as tf

DENSE = "dense"
CATEGORICAL = "categorical"   # one id per example
SEQUENCE = "sequence"         # multi-hot or behaviour sequence: up to max_len ids
KINDS = (DENSE, CATEGORICAL, SEQUENCE)


@dataclasses.dataclass(frozen=True)
class Feature:
    """One input feature.

    vocab_size: number of ids (including the reserved id 0) of a categorical or sequence
      feature; ids of hashed features are folded into this many buckets.
    hashed: whether raw values are hashed into vocab_size buckets (Criteo's hex strings)
      rather than being ids already.
    embedding_dim: a hint for models; they may use their own.
    max_len: the padded length of a sequence feature.
    dim: the width of a dense feature.
    group: optional name tying features together, e.g. a behaviour sequence and the
      one-hot feature it shares a vocabulary (and table) with: ("item", "hist_item").
    """
    name: str
    kind: str
    vocab_size: Optional[int] = None
    hashed: bool = False
    embedding_dim: Optional[int] = None
    max_len: Optional[int] = None
    dim: int = 1
    dtype: str = ""
    group: Optional[str] = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"feature {self.name!r}: kind {self.kind!r} is not one of {KINDS}")
        if not self.dtype:
            object.__setattr__(self, "dtype", "float32" if self.kind == DENSE else "int64")
        if self.kind != DENSE and (self.vocab_size is None or self.vocab_size < 2):
            raise ValueError(f"feature {self.name!r}: a {self.kind} feature needs vocab_size >= 2 "
                             f"(got {self.vocab_size}); id 0 is reserved for missing values")
        if self.kind == SEQUENCE and (self.max_len is None or self.max_len < 1):
            raise ValueError(f"feature {self.name!r}: a sequence feature needs max_len >= 1 "
                             f"(got {self.max_len})")
        if self.kind == DENSE and self.dim < 1:
            raise ValueError(f"feature {self.name!r}: dense dim must be >= 1 (got {self.dim})")

    @property
    def shape(self):
        """Per-example shape (without the batch dimension)."""
        if self.kind == SEQUENCE:
            return (self.max_len,)
        if self.kind == DENSE and self.dim > 1:
            return (self.dim,)
        return ()

    def tensor_spec(self, batch_size=None):
        return tf.TensorSpec((batch_size,) + self.shape, tf.as_dtype(self.dtype), name=self.name)

    def to_dict(self):
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


@dataclasses.dataclass(frozen=True)
class Schema:
    """An ordered list of features plus the label name(s)."""
    features: List[Feature]
    labels: List[str] = dataclasses.field(default_factory=lambda: ["label"])
    name: str = ""

    def __post_init__(self):
        object.__setattr__(self, "features", list(self.features))
        object.__setattr__(self, "labels", list(self.labels))
        names = [f.name for f in self.features]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"schema {self.name!r}: duplicate feature names {dupes}")
        if not self.labels:
            raise ValueError(f"schema {self.name!r}: needs at least one label")

    def __getitem__(self, name):
        for f in self.features:
            if f.name == name:
                return f
        raise KeyError(f"schema {self.name!r} has no feature {name!r}; it has {[f.name for f in self.features]}")

    def __contains__(self, name):
        return any(f.name == name for f in self.features)

    def of_kind(self, kind):
        return [f for f in self.features if f.kind == kind]

    @property
    def dense(self):
        return self.of_kind(DENSE)

    @property
    def categorical(self):
        return self.of_kind(CATEGORICAL)

    @property
    def sequences(self):
        return self.of_kind(SEQUENCE)

    def keras_inputs(self):
        """A dict name -> keras.Input, in schema order."""
        return {f.name: tf.keras.Input(shape=f.shape, dtype=f.dtype, name=f.name) for f in self.features}

    def tensor_specs(self, batch_size=None):
        """(features_spec, label_spec) of the datasets readers produce for this schema."""
        feats = {f.name: f.tensor_spec(batch_size) for f in self.features}
        if len(self.labels) == 1:
            label = tf.TensorSpec((batch_size,), tf.float32, name=self.labels[0])
        else:
            label = {n: tf.TensorSpec((batch_size,), tf.float32, name=n) for n in self.labels}
        return feats, label

    def to_json(self):
        return json.dumps({"name": self.name, "labels": self.labels,
                           "features": [f.to_dict() for f in self.features]}, indent=1)

    @classmethod
    def from_json(cls, text):
        d = json.loads(text)
        return cls(features=[Feature(**f) for f in d["features"]], labels=d.get("labels", ["label"]),
                   name=d.get("name", ""))

    def save(self, path):
        with open(path, "w") as f:
            f.write(self.to_json())

    @classmethod
    def load(cls, path):
        with open(path) as f:
            return cls.from_json(f.read())
