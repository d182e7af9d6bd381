"""Synthetic CTR data for any schema: Zipf-distributed ids, labels from a planted model.

Ids. Each categorical and sequence feature draws ids from a Zipf law: the id of
popularity rank r (r = 1 the hottest) has probability proportional to r^-s, s =
zipf_exponent (default 1.2: the hottest 20% of a 20,000-id vocabulary draw about 94%
of the accesses, beyond the "20% of ids, 70% of accesses" of the PICASSO paper, §II-B).
Ranks are drawn by inverting the continuous power law, and mapped to ids through a
random permutation per vocabulary, so hot ids are spread over [1, vocab_size).
Features of one `group` share their vocabulary and its permutation. A sequence holds a
uniform random number (1..max_len) of ids, right-padded with 0.

Dense values. A latent z ~ N(0, 1) per value is shown to the model as
log(1 + floor(exp(mu + sigma z))) with mu, sigma drawn per feature: log-scaled counts,
like Criteo's integer features after the usual log1p transform.

Labels. logit = bias + scale * (sum of terms) / sqrt(number of terms), with terms:
  - a weight per (feature, id) for every categorical feature;
  - num_interactions products of weights of two categorical features (FM-style);
  - for a sequence: the mean over its ids of a per-id weight, times the same weight of
    the group's one-hot target feature if the group has one (DIN-style relevance);
  - a weight times z for every dense value.
Per-id weights are a hash of (seed, id) spread over [-sqrt(3), sqrt(3)), so huge
vocabularies cost no memory. scale and bias are set on a calibration sample so that
the logit's standard deviation is logit_std and the mean probability is about
positive_rate. Labels ~ Bernoulli(sigmoid(logit)); the probabilities are kept in
TabularData.extras["planted_probability"] (a dict per label when there are several),
so a model's AUC can be set against the planted model's own on the same examples.

Everything is a function of the seed: same seed, same data, on any machine.
"""
import math

import numpy as np
import tensorflow as tf

from picasso_tf.data import pipeline
from picasso_tf.data.criteo import criteo_schema
from picasso_tf.data.dataset import TabularData
from picasso_tf.data.schema import CATEGORICAL, SEQUENCE, Feature, Schema

ZIPF_EXPONENT = 1.2
_SQRT3 = math.sqrt(3.0)
_CALIBRATION_ROWS = 8192
_CHUNK_ROWS = 65536


class _IdSampler:
    """Zipf-distributed ids in [1, vocab_size), hot ids scattered by a permutation."""

    def __init__(self, vocab_size, exponent, rng):
        if exponent < 0:
            raise ValueError(f"zipf_exponent must be >= 0, got {exponent}")
        self.size = vocab_size - 1
        self.exponent = float(exponent)
        self.id_of_rank = rng.permutation(self.size) + 1

    def __call__(self, rng, shape):
        u = rng.random(shape, dtype=np.float32)
        top = self.size + 1.0
        if self.exponent == 1.0:
            x = np.power(np.float32(top), u)
        else:   # inverse CDF of the density ~ x^-s on [1, top)
            edge = np.float32(top ** (1.0 - self.exponent) - 1.0)
            x = np.power(1.0 + u * edge, np.float32(1.0 / (1.0 - self.exponent)))
        ranks = x.astype(np.int64)   # >= 1 by construction; rounding may reach `top`
        ranks -= 1
        np.minimum(ranks, self.size - 1, out=ranks)
        return self.id_of_rank[ranks]


def _unit_weights(ids, key):
    """A fixed pseudo-random weight per (key, id), uniform on [-sqrt(3), sqrt(3)):
    mean 0, variance 1 (SplitMix64 of the id)."""
    z = ids.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15) + np.uint64(key)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z = z ^ (z >> np.uint64(31))
    return ((z >> np.uint64(40)).astype(np.float32) * np.float32(2.0 ** -24) - np.float32(0.5)) \
        * np.float32(2 * _SQRT3)


class _PlantedHead:
    """The planted model of one label: hash keys, interaction pairs, dense weights."""

    def __init__(self, schema, targets, rng, num_interactions):
        """targets: {group: the categorical feature a sequence of that group is compared with}."""
        def key():
            return int(rng.integers(0, 2 ** 63))

        categorical = [f.name for f in schema.categorical]
        self.main = {name: key() for name in categorical}
        pairs = [(a, b) for i, a in enumerate(categorical) for b in categorical[i + 1:]]
        chosen = rng.permutation(len(pairs))[:num_interactions]
        self.pairs = [(pairs[i], (key(), key())) for i in sorted(chosen)]
        self.sequence = {f.name: key() for f in schema.sequences}
        self.dense = {f.name: rng.standard_normal(f.dim).astype(np.float32) for f in schema.dense}
        self.num_terms = len(self.main) + len(self.pairs) + len(self.sequence) + len(self.dense)
        self.schema, self.targets = schema, targets
        self.scale, self.bias = 1.0, 0.0

    def raw(self, features, latents):
        """The logit before calibration, of examples `features` with dense `latents`."""
        total = np.zeros(len(next(iter(features.values()))), np.float32)
        for name, k in self.main.items():
            total += _unit_weights(features[name], k)
        for (a, b), (ka, kb) in self.pairs:
            total += _unit_weights(features[a], ka) * _unit_weights(features[b], kb)
        for f in self.schema.sequences:
            ids = features[f.name]
            weights = _unit_weights(ids, self.sequence[f.name]) * (ids != 0)
            pooled = weights.sum(axis=1) / np.maximum((ids != 0).sum(axis=1), 1)
            target = self.targets.get(f.group)
            total += pooled * _unit_weights(features[target], self.sequence[f.name]) if target else pooled
        for name, w in self.dense.items():
            total += latents[name].reshape(len(total), -1) @ w
        return total / np.float32(math.sqrt(max(self.num_terms, 1)))

    def calibrate(self, raw, logit_std, positive_rate):
        """Sets scale and bias so that on `raw` the logit has std logit_std and the mean
        probability is positive_rate (bisection on the bias)."""
        self.scale = logit_std / max(float(raw.std()), 1e-6)
        low, high = -30.0, 30.0
        for _ in range(60):
            self.bias = (low + high) / 2
            if _sigmoid(self.bias + self.scale * raw).mean() < positive_rate:
                low = self.bias
            else:
                high = self.bias

    def probability(self, raw):
        return _sigmoid(self.bias + self.scale * raw).astype(np.float32)


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


class SyntheticGenerator:
    """Draws examples of `schema` (see the module docstring); fixed by its seed.

    zipf_exponent: one exponent, or {feature name: exponent} (others get the default).
    positive_rate, logit_std, num_interactions: the planted model (a logit_std near
    1.5 gives the planted probabilities an AUC of about 0.8).
    """

    def __init__(self, schema, seed=0, *, zipf_exponent=ZIPF_EXPONENT, positive_rate=0.25, logit_std=1.5,
                 num_interactions=8):
        if not 0 < positive_rate < 1:
            raise ValueError(f"positive_rate must lie strictly between 0 and 1, got {positive_rate}")
        self.schema = schema
        self.seed = seed
        rng = np.random.default_rng([seed, 0])
        self._samplers, self._targets = {}, {}
        for f in schema.features:
            if f.kind == CATEGORICAL and f.group is not None:
                self._targets.setdefault(f.group, f.name)
            if f.kind in (CATEGORICAL, SEQUENCE):
                self._add_sampler(f, zipf_exponent, rng)
        self._dense = {f.name: (rng.uniform(0.0, 3.0), rng.uniform(0.5, 2.0)) for f in schema.dense}
        self._heads = {n: _PlantedHead(schema, self._targets, rng, num_interactions) for n in schema.labels}
        features, latents = self._draw(np.random.default_rng([seed, 3]), _CALIBRATION_ROWS)
        for head in self._heads.values():
            head.calibrate(head.raw(features, latents), logit_std, positive_rate)

    def _add_sampler(self, feature, zipf_exponent, rng):
        table = feature.group or feature.name
        exponent = zipf_exponent.get(feature.name, ZIPF_EXPONENT) if isinstance(zipf_exponent, dict) \
            else zipf_exponent
        if table in self._samplers:
            if self._samplers[table].size != feature.vocab_size - 1:
                raise ValueError(f"feature {feature.name!r}: group {table!r} mixes vocab sizes; features "
                                 "sharing a group share one vocabulary")
            return
        self._samplers[table] = _IdSampler(feature.vocab_size, exponent, rng)

    def _draw(self, rng, n):
        """(features, dense latents) of n examples."""
        features, latents = {}, {}
        for f in self.schema.features:
            if f.kind == CATEGORICAL:
                features[f.name] = self._samplers[f.group or f.name](rng, n)
            elif f.kind == SEQUENCE:
                ids = self._samplers[f.group or f.name](rng, (n, f.max_len))
                lengths = rng.integers(1, f.max_len + 1, n)
                ids[np.arange(f.max_len) >= lengths[:, None]] = 0
                features[f.name] = ids
            else:
                mu, sigma = self._dense[f.name]
                z = rng.standard_normal((n,) + f.shape, dtype=np.float32)
                latents[f.name] = z
                features[f.name] = np.log1p(np.floor(np.exp(mu + sigma * z))).astype(np.float32)
        return features, latents

    def sample(self, num_examples, rng):
        """(features, {label: float32 [N]}, {label: planted probability [N]}) drawn with rng.

        Rows are drawn in chunks so that temporaries stay small and are reused: fresh
        memory costs more than the arithmetic here.
        """
        features = {f.name: np.empty((num_examples,) + f.shape, f.dtype) for f in self.schema.features}
        probabilities = {n: np.empty(num_examples, np.float32) for n in self._heads}
        for start in range(0, num_examples, _CHUNK_ROWS):
            stop = min(start + _CHUNK_ROWS, num_examples)
            chunk, latents = self._draw(rng, stop - start)
            for name, values in chunk.items():
                features[name][start:stop] = values
            for name, head in self._heads.items():
                probabilities[name][start:stop] = head.probability(head.raw(chunk, latents))
        labels = {n: (rng.random(num_examples) < p).astype(np.float32) for n, p in probabilities.items()}
        return features, labels, probabilities

    def tabular(self, num_examples, rng):
        features, labels, probabilities = self.sample(num_examples, rng)
        planted = probabilities[self.schema.labels[0]] if len(probabilities) == 1 else probabilities
        return TabularData(self.schema, features, labels, extras={"planted_probability": planted})


def generate(schema, num_examples, seed=0, **options):
    """TabularData of num_examples synthetic examples; options go to SyntheticGenerator."""
    return SyntheticGenerator(schema, seed, **options).tabular(num_examples, np.random.default_rng([seed, 1]))


def generate_chunks(schema, num_examples, chunk_size=100_000, seed=0, **options):
    """The same kind of data as generate(), as TabularData chunks of chunk_size examples
    (for writing big files in bounded memory); deterministic by seed, though not the
    same examples as generate() draws."""
    generator = SyntheticGenerator(schema, seed, **options)
    rng = np.random.default_rng([seed, 2])
    for start in range(0, num_examples, chunk_size):
        yield generator.tabular(min(chunk_size, num_examples - start), rng)


def stream(schema, batch_size, num_batches=None, seed=0, prefetch=True, **options):
    """tf.data.Dataset of (features, label) batches drawn on the fly: endless, or
    num_batches long. The same seed gives the same batches."""
    generator = SyntheticGenerator(schema, seed, **options)

    def batches():
        rng = np.random.default_rng([seed, 4])
        count = 0
        while num_batches is None or count < num_batches:
            features, labels, _ = generator.sample(batch_size, rng)
            yield pipeline.split_labels(schema, {**features, **labels})
            count += 1

    dataset = tf.data.Dataset.from_generator(batches, output_signature=schema.tensor_specs(batch_size))
    return pipeline.finish(dataset, prefetch)


def alibaba_schema(num_onehot=7, num_sequences=12, seq_len=100, vocab_size=100_000, embedding_dim=16,
                   name="alibaba"):
    """Table II's Alibaba layout: num_onehot one-hot features cat0.. and num_sequences
    behaviour sequences seq0.. of seq_len ids (7 + 12 x 100 = 1,207 fields by default);
    sequence j shares the vocabulary (group) of one-hot feature cat{j % num_onehot}.
    vocab_size: ids per one-hot feature including id 0, one int or one per feature."""
    sizes = [vocab_size] * num_onehot if isinstance(vocab_size, int) else list(vocab_size)
    if len(sizes) != num_onehot:
        raise ValueError(f"vocab_size: expected {num_onehot} sizes, got {len(sizes)}")
    onehot = [Feature(f"cat{i}", CATEGORICAL, vocab_size=sizes[i], embedding_dim=embedding_dim,
                      group=f"cat{i}") for i in range(num_onehot)]
    sequences = [Feature(f"seq{j}", SEQUENCE, vocab_size=sizes[j % num_onehot], max_len=seq_len,
                         embedding_dim=embedding_dim, group=f"cat{j % num_onehot}")
                 for j in range(num_sequences)]
    return Schema(onehot + sequences, name=name)


def wide_schema(num_fields=200, vocab_size=20_000, embedding_dims=(8, 16, 32), name="wide"):
    """num_fields one-hot features f0.. whose embedding_dim hints cycle through
    embedding_dims; vocab_size (including id 0) is one int or one per feature."""
    sizes = [vocab_size] * num_fields if isinstance(vocab_size, int) else list(vocab_size)
    if len(sizes) != num_fields:
        raise ValueError(f"vocab_size: expected {num_fields} sizes, got {len(sizes)}")
    return Schema([Feature(f"f{i}", CATEGORICAL, vocab_size=sizes[i],
                           embedding_dim=embedding_dims[i % len(embedding_dims)]) for i in range(num_fields)],
                  name=name)


PRESETS = {"criteo": criteo_schema, "alibaba": alibaba_schema, "wide": wide_schema}


def preset_schema(preset, **options):
    """The schema of a synthetic preset ("criteo", "alibaba" or "wide"); options go to
    its schema function (criteo_schema, alibaba_schema, wide_schema)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[preset](**options)
