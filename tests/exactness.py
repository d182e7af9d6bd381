"""The check most tests of models written by others make: a plain model and the same model
under picasso_tf, trained batch by batch on the same data, give the same losses and the
same weights."""
import numpy as np
import tensorflow as tf


def assert_train_alike(baseline, optimized, features, labels, optimizer, batch, steps, atol=1e-5, weights_rtol=1e-4):
    """Compiles both with a fresh `optimizer` (a Keras name) and binary cross-entropy, trains
    `steps` batches of `batch` rows, and compares the losses and every weight."""
    losses = {}
    for name, model in (("baseline", baseline), ("picasso", optimized)):
        model.compile(optimizer=tf.keras.optimizers.get(optimizer), loss="binary_crossentropy")
        losses[name] = [model.train_on_batch({k: v[i * batch:(i + 1) * batch] for k, v in features.items()},
                                             labels[i * batch:(i + 1) * batch]) for i in range(steps)]
    np.testing.assert_allclose(losses["picasso"], losses["baseline"], rtol=1e-5, atol=atol)
    optimized.picasso.write_back()
    for b, o in zip(baseline.weights, optimized.original.weights):
        np.testing.assert_allclose(o.numpy(), b.numpy(), rtol=weights_rtol, atol=atol, err_msg=b.name)
