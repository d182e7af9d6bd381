"""Models and batches for the benchmark suite: the packing benchmark's wide models, the
dense-only bound of any functional Keras model, and pre-built in-memory batches.

Dense-only bound. `dense_only(model, tables)` rebuilds a functional model with every
embedding lookup removed: each call of a layer whose weights are all embedding tables
(an Embedding, an EmbeddingBag, ...) is replaced by a slice of one float input
"embeddings" of shape [B, sum of the flattened lookup outputs]; everything else (dense
features, interaction modules, MLPs) is the same layers called the same way. Runs of
slices that the model concatenates (Concatenate, tf.concat) or stacks (tf.stack) are
fed as one slice, so a model that concatenates its embeddings reads the input as it
is. The result times the dense part alone: the throughput a perfect embedding layer
would leave. It cannot be built (NotGeneric, with the reason) when a table sits in a
layer that also holds dense weights or lives inside a nested model, or when a
lookup's output shape is not static.
"""
import numpy as np
import tensorflow as tf

EMBEDDINGS = "embeddings"


class NotGeneric(ValueError):
    """The dense-only bound cannot be built for this model (the message says why)."""


# -- the packing benchmark's wide models ------------------------------------------------------

def build_wide_lr(schema, name="wide_lr"):
    """One sigmoid unit on the concatenation of one Embedding per one-hot field."""
    inputs = schema.keras_inputs()
    embs = [tf.keras.layers.Embedding(f.vocab_size, f.embedding_dim, name=f"emb_{f.name}")(inputs[f.name])
            for f in schema.categorical]
    x = tf.keras.layers.Concatenate(name="concat")(embs) if len(embs) > 1 else embs[0]
    out = tf.keras.layers.Dense(1, activation="sigmoid", name=schema.labels[0])(x)
    return tf.keras.Model(inputs, out, name=name)


def build_wide_wd(schema, hidden=(256, 128), name="wide_wd"):
    """The same embeddings, concatenated, through an MLP (ReLU) to a sigmoid unit."""
    inputs = schema.keras_inputs()
    embs = [tf.keras.layers.Embedding(f.vocab_size, f.embedding_dim, name=f"emb_{f.name}")(inputs[f.name])
            for f in schema.categorical]
    x = tf.keras.layers.Concatenate(name="concat")(embs) if len(embs) > 1 else embs[0]
    for i, units in enumerate(hidden):
        x = tf.keras.layers.Dense(units, activation="relu", name=f"mlp_{i}")(x)
    out = tf.keras.layers.Dense(1, activation="sigmoid", name=schema.labels[0])(x)
    return tf.keras.Model(inputs, out, name=name)


# -- batches ----------------------------------------------------------------------------------

def targets(model, label_dict):
    """The label structure `model` trains on: one array, or {output name: array}."""
    names = list(model.output_names)
    missing = [n for n in names if n not in label_dict]
    if missing:
        raise ValueError(f"model outputs {missing} have no label (labels: {sorted(label_dict)})")
    return label_dict[names[0]] if len(names) == 1 else {n: label_dict[n] for n in names}


def batches(data, model, batch_size, count):
    """`count` consecutive (features, labels) batches of `data` as tensors (wrapping)."""
    n = data.num_examples
    out = []
    for i in range(count):
        idx = np.arange(i * batch_size, (i + 1) * batch_size) % n
        features = {k: tf.constant(v[idx]) for k, v in data.features.items()}
        labels = tf.nest.map_structure(lambda a: tf.constant(a[idx]), targets(model, data.label_dict))
        out.append((features, labels))
    return out


def bound_batches(bound, width, source_batches, seed=0):
    """Batches for a dense-only bound model: its own inputs taken from the source
    batches, plus a random normal "embeddings" input of `width` floats per example."""
    rng = np.random.default_rng(seed)
    names = set(bound.input_names) - {EMBEDDINGS}
    out = []
    for features, labels in source_batches:
        size = int(next(iter(tf.nest.flatten(labels))).shape[0])
        x = {k: v for k, v in features.items() if k in names}
        x[EMBEDDINGS] = tf.constant(rng.standard_normal((size, width), dtype=np.float32))
        out.append((x, labels))
    return out


# -- the dense-only bound ---------------------------------------------------------------------

class _Slice:
    """A not yet materialized slice [start, start + width) of the embeddings input that
    stands for one lookup output of per-example shape `shape`."""

    def __init__(self, start, shape, node, ids):
        self.start, self.shape, self.node, self.ids = start, tuple(shape), node, ids
        self.width = int(np.prod(shape))
        self.tensor = None


@tf.keras.utils.register_keras_serializable("picasso_bench")
class EmbeddingSlice(tf.keras.layers.Layer):
    """embeddings[:, start:start + width] reshaped to `shape`; with ids given, the mask
    is the replaced layer's mask of those ids (e.g. mask_zero=True: ids != 0)."""

    def __init__(self, start, shape, mask_layer=None, **kwargs):
        super().__init__(**kwargs)
        self.start, self.shape_ = int(start), tuple(int(s) for s in shape)
        self.width = int(np.prod(self.shape_))
        # The replaced layer's compute_mask, kept as a plain function so that the layer
        # itself is not tracked (it is not part of the bound model).
        self._mask_of = mask_layer.compute_mask if mask_layer is not None else None

    def call(self, inputs):
        x = inputs[0] if isinstance(inputs, (list, tuple)) else inputs
        x = x[:, self.start:self.start + self.width]
        return tf.reshape(x, (-1,) + self.shape_) if len(self.shape_) != 1 else x

    def compute_mask(self, inputs, mask=None):
        if self._mask_of is None or not isinstance(inputs, (list, tuple)):
            return None
        return self._mask_of(inputs[1])

    def get_config(self):
        return {**super().get_config(), "start": self.start, "shape": self.shape_}


def _is_keras_tensor(x):
    return hasattr(x, "_keras_history")


def table_layers(model, tables):
    """{id(layer): layer} of the model's top-level layers whose weights are all in
    `tables` (variables); raises NotGeneric for a table held any other way."""
    table_refs = {t.ref() for t in tables}
    found, held = {}, set()
    for layer in model.layers:
        weights = layer.weights
        refs = {w.ref() for w in weights}
        if weights and refs <= table_refs and not isinstance(layer, tf.keras.Model):
            found[id(layer)] = layer
            held |= refs
    stray = [t.name for t in tables if t.ref() not in held]
    if stray:
        raise NotGeneric(f"embedding table(s) {stray[:3]} sit in a layer that also holds dense weights "
                         "or in a nested model")
    return found


def dense_only(model, tables):
    """(bound model, width of its "embeddings" input); see the module docstring.

    model: a functional keras.Model; tables: its embedding table variables (e.g. the
    ones picasso_tf's analysis found, mapped to this model's variables).
    """
    if not getattr(model, "_is_graph_network", False):
        raise NotGeneric("not a functional model: its layer graph cannot be rebuilt")
    sites = table_layers(model, tables)
    if not sites:
        raise NotGeneric("no embedding layer found")
    width = _lookup_width(model, sites)
    return _rebuild_with_width(model, sites, width), width


def _lookup_width(model, sites):
    """Sum of the flattened per-example sizes of the lookup outputs the outputs need."""
    seen, width = set(), 0
    stack = list(tf.nest.flatten(model.outputs))
    while stack:
        t = stack.pop()
        layer, node_index, _ = t._keras_history
        node = layer._inbound_nodes[node_index]
        if id(node) in seen:
            continue
        seen.add(id(node))
        if id(layer) in sites:
            for out in tf.nest.flatten(node.outputs):
                shape = out.shape[1:]
                if not shape.is_fully_defined():
                    raise NotGeneric(f"lookup {layer.name} has a dynamic output shape {out.shape}")
                width += int(np.prod(shape.as_list()))
            if any(getattr(o, "_keras_mask", None) is not None for o in tf.nest.flatten(node.outputs)):
                stack.extend(node.keras_inputs)        # the ids feed the mask
            continue
        stack.extend(node.keras_inputs)
    return width


def _rebuild_with_width(model, sites, width):
    """The same construction as dense_only with the embeddings input at its real width
    (the width is only known after a first pass over the graph)."""
    emb_input = tf.keras.Input((width,), name=EMBEDDINGS)
    state = {"next": 0}
    new_inputs, memo, count = {}, {}, [0]

    def original_input(t):
        name = t._keras_history.layer.name
        if name not in new_inputs:
            new_inputs[name] = tf.keras.Input(type_spec=t.type_spec, name=name)
        return new_inputs[name]

    def value(t):
        key = id(t)
        if key in memo:
            return memo[key]
        layer, node_index, _ = t._keras_history
        node = layer._inbound_nodes[node_index]
        flat_outputs = tf.nest.flatten(node.outputs)
        if isinstance(layer, tf.keras.layers.InputLayer):
            memo[key] = original_input(t)
        elif id(layer) in sites:
            for out in flat_outputs:
                ids = node.keras_inputs[0] if getattr(out, "_keras_mask", None) is not None else None
                memo[id(out)] = _Slice(state["next"], out.shape[1:].as_list(), node, ids)
                state["next"] += memo[id(out)].width
        else:
            collapsed = _collapse(layer, node, value)
            if collapsed is not None:
                memo[id(flat_outputs[0])] = collapsed
            else:
                args, kwargs = tf.nest.map_structure(
                    lambda a: materialize(value(a)) if _is_keras_tensor(a) else a, (node.call_args, node.call_kwargs))
                for out, new in zip(flat_outputs, tf.nest.flatten(layer(*args, **kwargs))):
                    memo[id(out)] = new
        return memo[key]

    def materialize(v):
        if isinstance(v, _Merged):
            return v.build(materialize)
        if not isinstance(v, _Slice):
            return v
        if v.tensor is None:
            mask_layer = v.node.layer if v.ids is not None else None
            layer = EmbeddingSlice(v.start, v.shape, mask_layer, name=f"embedding_slice_{count[0]}")
            count[0] += 1
            if v.ids is None and v.start == 0 and v.width == width and len(v.shape) == 1:
                v.tensor = emb_input
            else:
                v.tensor = layer([emb_input, materialize(value(v.ids))] if v.ids is not None else emb_input)
        return v.tensor

    outputs = tf.nest.map_structure(lambda t: materialize(value(t)), model.outputs)
    inputs = {EMBEDDINGS: emb_input, **new_inputs}
    return tf.keras.Model(inputs, outputs, name=f"{model.name}_dense_only")


class _Merged:
    """A concat/stack whose operands include runs of adjacent slices, merged lazily."""

    def __init__(self, kind, parts, axis):
        self.kind, self.parts, self.axis = kind, parts, axis
        self.tensor = None

    def build(self, materialize):
        if self.tensor is not None:
            return self.tensor
        pieces = []
        for part in self.parts:
            if isinstance(part, list):          # a run of adjacent slices of equal rank-1 shape
                first = part[0]
                merged = _Slice(first.start, (sum(p.width for p in part),), None, None)
                x = materialize(merged)
                if self.kind == "stack":
                    x = tf.keras.layers.Reshape((len(part),) + first.shape)(x)
                pieces.append(x)
            else:
                x = materialize(part)
                if self.kind == "stack":
                    x = tf.expand_dims(x, self.axis)
                pieces.append(x)
        self.tensor = pieces[0] if len(pieces) == 1 else tf.concat(pieces, axis=self.axis)
        return self.tensor


def _collapse(layer, node, value):
    """For a concat/stack of lookup outputs: a _Merged whose adjacent slices are read as
    one (None when the node is anything else or no two operands are adjacent slices)."""
    kind, axis, operands = None, None, None
    args, kwargs = node.call_args, node.call_kwargs
    if isinstance(layer, tf.keras.layers.Concatenate):
        kind, axis, operands = "concat", layer.axis, args[0] if args else kwargs.get("inputs")
    elif type(layer).__name__ == "TFOpLambda" and getattr(layer, "symbol", None) in ("concat", "stack"):
        kind = layer.symbol
        operands = args[0] if args else kwargs.get("values")
        axis = args[1] if len(args) > 1 else kwargs.get("axis", 0)
    if kind is None or not isinstance(operands, (list, tuple)) or not all(_is_keras_tensor(o) for o in operands):
        return None
    rank = len(operands[0].shape)
    if kind == "concat" and not (rank == 2 and axis in (-1, 1)):
        return None
    if kind == "stack" and not (rank == 2 and axis in (1, -2)):
        return None
    values = [value(o) for o in operands]
    parts, run = [], []
    for v in values:
        ok = isinstance(v, _Slice) and v.ids is None and len(v.shape) == 1
        if ok and run and run[-1].start + run[-1].width == v.start and \
                (kind == "concat" or v.shape == run[-1].shape):
            run.append(v)
            continue
        if run:
            parts.append(run)
        run = [v] if ok else []
        if not ok:
            parts.append(v)
    if run:
        parts.append(run)
    if not any(isinstance(p, list) and len(p) > 1 for p in parts):
        return None
    return _Merged(kind, parts, 1)


def corresponding_variables(source, variables, target):
    """The variables of `target` (built by the same builder as `source`) at the
    positions `variables` hold among source.weights."""
    wanted = {v.ref() for v in variables}
    return [t for s, t in zip(source.weights, target.weights) if s.ref() in wanted]
