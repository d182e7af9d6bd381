"""Models and batches for the benchmark suite: the packing benchmark's wide models, the
dense-only bound of any functional Keras model, and pre-built in-memory batches.

Dense-only bound. `dense_only(model, tables)` rebuilds a functional model with every
embedding lookup removed: each call of a layer whose weights are all embedding tables
(an Embedding, an EmbeddingBag, ...) is replaced by a slice of one float input
"embeddings" of shape [B, sum of the flattened lookup outputs]; everything else (dense
features, interaction modules, MLPs) is the same layers called the same way. Runs of
slices that the model concatenates (Concatenate, tf.concat) or stacks (tf.stack) are
fed as one slice, so a model that concatenates its embeddings reads the input as it
is. A layer that holds tables beside dense weights, or a nested model holding tables,
stays in the bound with its dense computation, called with each gather from its tables
(tf.gather, tf.nn.embedding_lookup, Keras Embedding) replaced by a slice
(LookupSlices). Each slice passes through a trained zero bias of its shape, so the
bound's step computes the loss's gradient with respect to the lookups' outputs, as the
step of any model whose tables train must (it is the dense part's backward, not the
embedding layer's), and then sums it over the batch (per slice: a gradient taken of
the whole input would scatter every slice's into a zero tensor of the input's width). The
result times the dense part alone: the throughput a perfect embedding layer would leave. It cannot be built (NotGeneric, with the reason) when a
table is held outside the model's layers, when a table in such a mixed layer is read
other than by a gather, or when a lookup's output is not one static block per example.
"""
import contextlib
import functools

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
        self.gradient = gradient_bias(self, self.shape_)

    def call(self, inputs):
        x = inputs[0] if isinstance(inputs, (list, tuple)) else inputs
        x = x[:, self.start:self.start + self.width]
        return (tf.reshape(x, (-1,) + self.shape_) if len(self.shape_) != 1 else x) + self.gradient

    def compute_mask(self, inputs, mask=None):
        if self._mask_of is None or not isinstance(inputs, (list, tuple)):
            return None
        return self._mask_of(inputs[1])

    def get_config(self):
        return {**super().get_config(), "start": self.start, "shape": self.shape_}


def gradient_bias(layer, shape, name="gradient"):
    """A trained zero weight of per-example `shape` for `layer` to add to a slice: the step
    then takes the loss's gradient with respect to the slice (see the module docstring)."""
    return layer.add_weight(name, shape, initializer="zeros")


@tf.keras.utils.register_keras_serializable("picasso_bench")
class EmbeddingsGradient(tf.keras.layers.Layer):
    """x + a gradient_bias: the whole embeddings input, where the model reads it as it is."""

    def build(self, shape):
        self.gradient = gradient_bias(self, (shape[-1],))

    def call(self, x):
        return x + self.gradient


def _is_keras_tensor(x):
    return hasattr(x, "_keras_history")


def analysed_tables(program):
    """The original model's table variables that picasso_tf's analysis of its training
    forward found, from its Program (a model's packed storages may hold these same
    variables or copies of them)."""
    return list(program.analyses["training"].tables.values())


def table_layers(model, tables):
    """({id(layer): layer} of the model's top-level layers whose weights are all in
    `tables` (variables), {id(layer): (layer, its tables)} of those that hold tables beside
    other weights, nested models included); raises NotGeneric for a table held elsewhere."""
    table_refs = {t.ref() for t in tables}
    pure, mixed, held = {}, {}, set()
    for layer in model.layers:
        refs = {w.ref() for w in layer.weights}
        if not refs & table_refs:
            continue
        if refs <= table_refs and not isinstance(layer, tf.keras.Model):
            pure[id(layer)] = layer
        else:
            mixed[id(layer)] = (layer, [t for t in tables if t.ref() in refs])
        held |= refs
    stray = [t.name for t in tables if t.ref() not in held]
    if stray:
        raise NotGeneric(f"embedding table(s) {stray[:3]} are held outside the model's layers")
    return pure, mixed


class TableReads:
    """The gathers from some tables: while `replaced(read)` is active, each one traced in
    a graph returns read(table, ids, original) instead. tf.gather, tf.nn.embedding_lookup
    and Keras' Embedding all gather from a resource variable through its sparse_read.
    (A plain object, so that a layer holding it does not track the tables as weights.)"""

    def __init__(self, tables):
        self.tables = list(tables)

    @contextlib.contextmanager
    def replaced(self, read):
        def sparse_read(table, original, ids, name=None):
            try:
                return read(table, ids, original)
            except AttributeError as e:     # tf.gather would take it for "not a variable" and gather
                raise RuntimeError(f"reading a gather from {table.name}: {e}") from e

        for t in self.tables:
            t.sparse_read = functools.partial(sparse_read, t, type(t).sparse_read.__get__(t))
        try:
            yield
        finally:
            for t in self.tables:
                del t.sparse_read


class LookupSlices(tf.keras.layers.Layer):
    """Calls `layer` (one holding tables beside dense weights, or a nested model) with its
    gathers from `tables` answered, in call order, by slices of the embeddings input:
    `slices` is [(start, per-example shape)] per gather. Its trainable weights are the
    layer's without the tables, which the bound does not train."""

    def __init__(self, layer, tables, slices, **kwargs):
        super().__init__(**kwargs)
        self.layer = layer
        self._reads = TableReads(tables)
        self._slices = [(int(start), tuple(shape)) for start, shape in slices]
        self._gradients = [gradient_bias(self, shape, f"gradient_{k}") for k, (_, shape) in enumerate(self._slices)]

    @property
    def trainable_weights(self):
        tables = {t.ref() for t in self._reads.tables}
        return [w for w in self.layer.trainable_weights if w.ref() not in tables] + self._gradients

    def call(self, embeddings, *args, **kwargs):
        pending = iter(zip(self._slices, self._gradients))

        def read(table, ids, original):
            (start, shape), gradient = next(pending)
            return tf.reshape(embeddings[:, start:start + int(np.prod(shape))], (-1,) + shape) + gradient

        with self._reads.replaced(read):
            return self.layer(*args, **kwargs)


def dense_only(model, tables):
    """(bound model, width of its "embeddings" input); see the module docstring.

    model: a functional keras.Model; tables: its embedding table variables (e.g. the
    ones picasso_tf's analysis found, mapped to this model's variables).
    """
    if not getattr(model, "_is_graph_network", False):
        raise NotGeneric("not a functional model: its layer graph cannot be rebuilt")
    sites, mixed = table_layers(model, tables)
    if not sites and not mixed:
        raise NotGeneric("no embedding layer found")
    width, gathers = _lookup_width(model, sites, mixed)
    return _rebuild_with_width(model, sites, mixed, gathers, width), width


# A batch size no model fixes, to tell a gather's per-example rows from other leading dims.
_PROBE_BATCH = 7


def _gather_shapes(layer, tables, node):
    """Per-example shapes of the gathers from `tables`, in order, that this call of `layer`
    makes (traced on its inputs' specs with the batch size fixed)."""
    shapes = []

    def record(table, ids, original):
        out = original(ids)
        if out.shape.rank is None or out.shape[0] != _PROBE_BATCH or not out.shape[1:].is_fully_defined():
            raise NotGeneric(f"a lookup of {table.name} in {layer.name} is not one static block per example "
                             f"(shape {out.shape} at batch {_PROBE_BATCH})")
        shapes.append((table.name, tuple(out.shape[1:].as_list())))
        return out

    def spec(a):
        if not _is_keras_tensor(a):
            return a
        if not isinstance(a.type_spec, tf.TensorSpec):
            raise NotGeneric(f"{layer.name} takes a {type(a.type_spec).__name__} input")
        return tf.TensorSpec([_PROBE_BATCH] + a.shape[1:].as_list(), a.dtype)

    args, kwargs = tf.nest.map_structure(spec, (node.call_args, node.call_kwargs))
    with TableReads(tables).replaced(record):
        tf.function(lambda *a, **k: layer(*a, **k), autograph=False).get_concrete_function(*args, **kwargs)
    return shapes


def _lookup_width(model, sites, mixed):
    """(Sum of the flattened per-example sizes of the lookup outputs the outputs need,
    {id(node): [(table name, shape)] of the gathers of each needed call of a mixed layer})."""
    seen, width, gathers = set(), 0, {}
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
        if id(layer) in mixed:
            gathers[id(node)] = _gather_shapes(layer, mixed[id(layer)][1], node)
            width += sum(int(np.prod(shape)) for _, shape in gathers[id(node)])
        stack.extend(node.keras_inputs)
    for layer, layer_tables in mixed.values():
        calls = [gathers[id(node)] for node in layer._inbound_nodes if id(node) in gathers]
        gathered = {name for call in calls for name, _ in call}
        unread = [t.name for t in layer_tables if t.name not in gathered]
        if calls and unread:
            raise NotGeneric(f"{layer.name} reads table(s) {unread[:3]} other than by a gather")
    return width, gathers


def _rebuild_with_width(model, sites, mixed, gathers, width):
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
        elif id(layer) in mixed:
            slices = []
            for _, shape in gathers[id(node)]:
                slices.append((state["next"], shape))
                state["next"] += int(np.prod(shape))
            wrapper = LookupSlices(layer, mixed[id(layer)][1], slices, name=f"{layer.name}_lookup_slices_{node_index}")
            call_again(node, lambda *args, **kwargs: wrapper(emb_input, *args, **kwargs))
        else:
            collapsed = _collapse(layer, node, value)
            if collapsed is not None:
                memo[id(flat_outputs[0])] = collapsed
            else:
                call_again(node, layer)
        return memo[key]

    def call_again(node, fn):
        """fn called as the node's layer was, on the rebuilt values of its inputs."""
        args, kwargs = tf.nest.map_structure(
            lambda a: materialize(value(a)) if _is_keras_tensor(a) else a, (node.call_args, node.call_kwargs))
        for out, new in zip(tf.nest.flatten(node.outputs), tf.nest.flatten(fn(*args, **kwargs))):
            memo[id(out)] = new

    def materialize(v):
        if isinstance(v, _Merged):
            return v.build(materialize)
        if not isinstance(v, _Slice):
            return v
        if v.tensor is None:
            count[0] += 1
            if v.ids is None and v.start == 0 and v.width == width and len(v.shape) == 1:
                v.tensor = EmbeddingsGradient(name=f"embeddings_gradient_{count[0]}")(emb_input)
            else:
                mask_layer = v.node.layer if v.ids is not None else None
                layer = EmbeddingSlice(v.start, v.shape, mask_layer, name=f"embedding_slice_{count[0]}")
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
