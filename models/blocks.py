"""Building blocks shared by the zoo's models: MLP, masked pooling, target attention.

Every layer here is registered for Keras serialisation (package "picasso_zoo") and
implements get_config, so `tf.keras.Model.from_config(model.get_config())` works.
"""
import tensorflow as tf

PACKAGE = "picasso_zoo"
serializable = tf.keras.utils.register_keras_serializable(package=PACKAGE)


@serializable
class MLP(tf.keras.layers.Layer):
    """A stack of Dense layers: hidden `units` with `activation`, optional dropout."""

    def __init__(self, units=(64, 32), activation="relu", dropout=0.0, l2=0.0, **kwargs):
        super().__init__(**kwargs)
        self.units = [int(u) for u in units]
        self.activation = activation
        self.dropout = float(dropout)
        self.l2 = float(l2)
        reg = tf.keras.regularizers.l2(self.l2) if self.l2 else None
        self.dense_layers = [tf.keras.layers.Dense(u, activation=activation, kernel_regularizer=reg,
                                                   name=f"dense_{i}")
                             for i, u in enumerate(self.units)]
        self.dropouts = [tf.keras.layers.Dropout(self.dropout) for _ in self.units] if self.dropout else []

    def call(self, x, training=None):
        for i, layer in enumerate(self.dense_layers):
            x = layer(x)
            if self.dropouts:
                x = self.dropouts[i](x, training=training)
        return x

    def get_config(self):
        return {**super().get_config(), "units": self.units, "activation": self.activation,
                "dropout": self.dropout, "l2": self.l2}


@serializable
class MaskedPooling(tf.keras.layers.Layer):
    """Pools [B, L, d] embeddings over L ignoring padding: combiner "sum" or "mean".

    The mask is the Keras mask (from `Embedding(mask_zero=True)`) or, when called as
    `pool([emb, ids])`, `ids != 0`. An all-padding row pools to zeros (never NaN).
    """

    def __init__(self, combiner="mean", **kwargs):
        super().__init__(**kwargs)
        if combiner not in ("sum", "mean"):
            raise ValueError(f"combiner must be 'sum' or 'mean', got {combiner!r}")
        self.combiner = combiner
        self.supports_masking = True

    def call(self, inputs, mask=None):
        if isinstance(inputs, (list, tuple)):
            emb, ids = inputs
            mask = tf.not_equal(ids, 0)
        else:
            emb = inputs
            if mask is None:
                mask = tf.ones(tf.shape(emb)[:2], tf.bool)
        m = tf.expand_dims(tf.cast(mask, emb.dtype), -1)
        total = tf.reduce_sum(emb * m, axis=1)
        if self.combiner == "sum":
            return total
        return tf.math.divide_no_nan(total, tf.reduce_sum(m, axis=1))

    def compute_mask(self, inputs, mask=None):
        return None

    def get_config(self):
        return {**super().get_config(), "combiner": self.combiner}


@serializable
class TargetAttention(tf.keras.layers.Layer):
    """DIN's local activation unit: scores each key against the query with a small MLP.

    call([query [B, d], keys [B, L, d], mask [B, L] bool]) -> pooled [B, d]
    (or scores [B, L] with return_scores). Inputs to the MLP are
    [q, k, q - k, q * k]; scores of padded keys are zeroed (DIN, softmax=False) or
    excluded from the softmax (softmax=True, as in DIEN/DSIN).
    """

    def __init__(self, units=(32, 16), activation="sigmoid", softmax=False, return_scores=False,
                 **kwargs):
        super().__init__(**kwargs)
        self.units = [int(u) for u in units]
        self.activation = activation
        self.softmax = bool(softmax)
        self.return_scores = bool(return_scores)
        self.mlp = MLP(self.units, activation=activation, name="att_mlp")
        self.score = tf.keras.layers.Dense(1, name="att_score")

    def call(self, inputs):
        query, keys, mask = inputs
        length = tf.shape(keys)[1]
        q = tf.tile(tf.expand_dims(query, 1), [1, length, 1])
        x = tf.concat([q, keys, q - keys, q * keys], axis=-1)
        scores = tf.squeeze(self.score(self.mlp(x)), -1)               # [B, L]
        mask = tf.cast(mask, tf.bool)
        if self.softmax:
            scores = tf.where(mask, scores, tf.fill(tf.shape(scores), -1e9))
            scores = tf.nn.softmax(scores, axis=-1) * tf.cast(mask, scores.dtype)
        else:
            scores = scores * tf.cast(mask, scores.dtype)
        if self.return_scores:
            return scores
        return tf.reduce_sum(tf.expand_dims(scores, -1) * keys, axis=1)

    def get_config(self):
        return {**super().get_config(), "units": self.units, "activation": self.activation,
                "softmax": self.softmax, "return_scores": self.return_scores}


@serializable
class NotPadding(tf.keras.layers.Layer):
    """ids [B, L] -> bool mask [B, L] of real (non-zero) ids."""

    def call(self, ids):
        return tf.not_equal(ids, 0)


@serializable
class SumLogits(tf.keras.layers.Layer):
    """Adds [B, 1] logits (and a trainable bias when use_bias)."""

    def __init__(self, use_bias=True, **kwargs):
        super().__init__(**kwargs)
        self.use_bias = bool(use_bias)

    def build(self, input_shape):
        if self.use_bias:
            self.bias = self.add_weight(name="bias", shape=(1,), initializer="zeros")
        super().build(input_shape)

    def call(self, logits):
        total = tf.add_n(list(logits)) if isinstance(logits, (list, tuple)) else logits
        return total + self.bias if self.use_bias else total

    def get_config(self):
        return {**super().get_config(), "use_bias": self.use_bias}
