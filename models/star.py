"""STAR: Star Topology Adaptive Recommender (Sheng et al., "One Model to Serve All: Star
Topology Adaptive Recommender for Multi-Domain CTR Prediction", CIKM 2021).

Multi-domain CTR: a domain indicator feature selects, per example, domain-specific
parameters that are combined with shared ones:
  * partitioned normalization (PN): gamma * gamma_p, beta + beta_p after normalising;
  * star-topology FCN: every layer's weights are W_shared (*) W_p (element-wise),
    biases b_shared + b_p;
  * an auxiliary network (domain embedding -> small MLP) whose logit is added.
The domain feature is `domain_feature` (a one-hot categorical feature name); by
default the one-hot feature with the smallest vocabulary of at least 3 ids (e.g.
MovieLens' gender: missing/F/M); its vocab_size is the number of domains.

Deviation, documented: PN here normalises with per-example (layer) statistics instead
of batch statistics, so that no op couples the examples of a batch (micro-batching and
serving give the same result). Embedding style: per-feature `Embedding`; bags use
`mask_zero=True` with masked mean pooling. The paper uses a deep star
FCN and a 2-layer auxiliary network. Scaled defaults: FCN 64-32, auxiliary 16.
"""
import tensorflow as tf

from . import inputs as zin
from .blocks import MLP, MaskedPooling, SumLogits, serializable

TRAINING = dict(optimizer="adam", learning_rate=0.002, epochs=2, batch_size=512)
META = dict(paper="Sheng et al. 2021, STAR", needs=("domain",),
            description="multi-domain: star-topology FCN + partitioned normalization")


@serializable
class PartitionedNorm(tf.keras.layers.Layer):
    """call([x [B, n], domain [B]]): normalise x, then per-domain scale and shift."""

    def __init__(self, num_domains, epsilon=1e-5, **kwargs):
        super().__init__(**kwargs)
        self.num_domains, self.epsilon = int(num_domains), float(epsilon)

    def build(self, input_shape):
        n = int(input_shape[0][-1])
        self.gamma = self.add_weight(name="gamma", shape=(n,), initializer="ones")
        self.beta = self.add_weight(name="beta", shape=(n,), initializer="zeros")
        self.domain_gamma = self.add_weight(name="domain_gamma", shape=(self.num_domains, n),
                                            initializer="ones")
        self.domain_beta = self.add_weight(name="domain_beta", shape=(self.num_domains, n),
                                           initializer="zeros")
        super().build(input_shape)

    def call(self, inputs):
        x, domain = inputs
        # Written out rather than tf.nn.moments + rsqrt: TF 2.15's oneDNN layer-norm fusion
        # matches that pattern, expects constant gamma/beta and aborts the process on
        # per-example (gathered) ones ("key not found: value") in inference graphs.
        centered = x - tf.reduce_mean(x, axis=-1, keepdims=True)
        var = tf.reduce_mean(centered * centered, axis=-1, keepdims=True)
        x = centered / tf.sqrt(var + self.epsilon)
        gamma = self.gamma * tf.gather(self.domain_gamma, domain)
        beta = self.beta + tf.gather(self.domain_beta, domain)
        return x * gamma + beta

    def get_config(self):
        return {**super().get_config(), "num_domains": self.num_domains, "epsilon": self.epsilon}


@serializable
class StarDense(tf.keras.layers.Layer):
    """call([x [B, n], domain [B]]) -> act(x @ (W * W_domain) + b + b_domain)."""

    def __init__(self, units, num_domains, activation="relu", **kwargs):
        super().__init__(**kwargs)
        self.units, self.num_domains = int(units), int(num_domains)
        self.activation = tf.keras.activations.get(activation)

    def build(self, input_shape):
        n = int(input_shape[0][-1])
        self.kernel = self.add_weight(name="kernel", shape=(n, self.units), initializer="glorot_uniform")
        self.bias = self.add_weight(name="bias", shape=(self.units,), initializer="zeros")
        self.domain_kernel = self.add_weight(name="domain_kernel", shape=(self.num_domains, n, self.units),
                                             initializer="ones")
        self.domain_bias = self.add_weight(name="domain_bias", shape=(self.num_domains, self.units),
                                           initializer="zeros")
        super().build(input_shape)

    def call(self, inputs):
        x, domain = inputs
        # x @ (W * W_p) for every domain p at once, then each example picks its own domain:
        # one plain MatMul [B, n] x [n, P*units] (cheaper than per-example weights while
        # the number of domains is below the batch size).
        n, p = self.kernel.shape[0], self.num_domains
        w = self.kernel[None] * self.domain_kernel                       # [P, n, units]
        w = tf.reshape(tf.transpose(w, [1, 0, 2]), [n, p * self.units])
        y_all = tf.reshape(tf.matmul(x, w), [-1, p, self.units])          # [B, P, units]
        y = tf.gather(y_all, domain, batch_dims=1) + self.bias + tf.gather(self.domain_bias, domain)
        return self.activation(y)

    def get_config(self):
        return {**super().get_config(), "units": self.units, "num_domains": self.num_domains,
                "activation": tf.keras.activations.serialize(self.activation)}


def build_star(schema, embedding_dim=8, hidden=(64, 32), aux_hidden=(16,), domain_feature=None):
    domain_f = zin.pick_categorical(schema, domain_feature, smallest=True, role="STAR's domain_feature")
    inputs = schema.keras_inputs()
    domain = inputs[domain_f.name]
    parts = []
    for f in schema.categorical:
        parts.append(tf.keras.layers.Embedding(f.vocab_size, zin.dim_of(f, embedding_dim),
                                               name=f"emb_{f.name}")(inputs[f.name]))
    for f in schema.sequences:
        emb = tf.keras.layers.Embedding(f.vocab_size, zin.dim_of(f, embedding_dim), mask_zero=True,
                                        name=f"emb_{f.name}")
        parts.append(MaskedPooling("mean", name=f"mean_{f.name}")(emb(inputs[f.name])))
    parts.append(zin.dense_block(schema, inputs))
    x = zin.concat(parts, "shared_embeddings")

    n_dom = domain_f.vocab_size
    x = PartitionedNorm(n_dom, name="partitioned_norm")([x, domain])
    for i, units in enumerate(hidden):
        x = StarDense(units, n_dom, name=f"star_fcn_{i}")([x, domain])
    main_logit = StarDense(1, n_dom, activation=None, name="star_logit")([x, domain])

    dom_emb = tf.keras.layers.Embedding(n_dom, embedding_dim, name="aux_domain_emb")(domain)
    aux_logit = tf.keras.layers.Dense(1, name="aux_logit")(MLP(aux_hidden, name="aux_mlp")(dom_emb))
    logit = SumLogits(use_bias=False, name="star_plus_aux")([main_logit, aux_logit])
    return tf.keras.Model(inputs, zin.sigmoid_output(logit, schema), name="star")
