"""HybridHash (a hot tier in front of hash tables) and a dynamic vocabulary (tables
keyed by raw id, growing as ids arrive), on generated data. See
docs/hybrid-hash-and-vocabularies.md.

    python examples/hybrid_hash_and_vocabulary.py
"""
import numpy as np
import tensorflow as tf

import picasso_tf
import picasso_tf.models as zoo
from picasso_tf.data import criteo_schema, generate

tf.keras.utils.set_random_seed(0)

# -- HybridHash: the zoo's Wide & Deep, its tables in hash tables behind a small hot tier --
schema = criteo_schema(buckets=2000)
data = generate(schema, 2048, seed=0)
model = picasso_tf.optimize(zoo.get("wide_deep")(schema), hybrid_hash=True,
                            hot_storage_bytes=64 << 10,          # 64 KiB of hot rows over all groups
                            hot_warmup_steps=5, hot_refresh_every=5)
model.compile(optimizer=tf.keras.optimizers.Adagrad(0.05), loss="binary_crossentropy")
logs = model.fit(data.dataset(128, shuffle=True), epochs=2, verbose=0).history
print(f"hybrid_hash: loss {logs['loss'][-1]:.4f}, hot_hit_ratio {logs['hot_hit_ratio'][-1]:.3f}, "
      f"hot_tier_rows {int(logs['hot_tier_rows'][-1])}")


# -- A dynamic vocabulary: raw user ids hashed into 100 bins in the model as written --
def build_hashed_model():
    user = tf.keras.Input((1,), dtype=tf.int64, name="user")
    rows = tf.keras.layers.Embedding(100, 8)(tf.keras.layers.Hashing(100)(user))   # ids collide in 100 bins
    return tf.keras.Model(user, tf.keras.layers.Dense(1, activation="sigmoid")(tf.keras.layers.Flatten()(rows)))


rng = np.random.default_rng(0)
users = rng.zipf(1.3, (2048, 1)) * 7919                   # skewed raw ids from a large space
labels = (users % 3 == 0).astype("float32")
model = picasso_tf.optimize(build_hashed_model(), dynamic_vocabulary=True,
                            vocabulary_capacity=300,      # keys per table; beyond it the least used go
                            admit_after=2)                # a row from an id's second lookup on
model.compile(optimizer=tf.keras.optimizers.Adagrad(0.05), loss="binary_crossentropy")
logs = model.fit(users, labels, batch_size=128, epochs=2, verbose=0).history
(keys, table_rows), = model.picasso.vocabulary().values()
print(f"dynamic_vocabulary: loss {logs['loss'][-1]:.4f}, keys held {int(logs['vocabulary_keys'][-1])}, "
      f"distinct ids seen {len(np.unique(users))}, rows exported {table_rows.shape}")
