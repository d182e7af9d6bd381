"""A SavedModel for serving with stock TensorFlow: ``model.picasso.export(directory)``.

A SavedModel of the wrapped model itself (``model.save(dir)``, ``tf.saved_model.save``)
holds the rewritten graph, whose fused kernels are picasso_tf's custom ops: loading it
needs picasso_tf's op library. The export is the ORIGINAL model's graph instead, with
the trained weights (its variables are the ones picasso_tf trained), and the serving
signature Keras gives the model (``serving_default``, inputs and outputs by Keras'
names): ``tf.saved_model.load(directory).signatures["serving_default"](**features)``
in a process that has only TensorFlow.
"""
import tensorflow as tf


def export_saved_model(model, directory):
    """Saves the plain keras.Model `model` with its serving signature."""
    if model._get_save_spec() is None:
        # Without it Keras gives no serving signature: the SavedModel would serve nothing.
        raise ValueError(
            f"picasso_tf: cannot export {model.name}: Keras does not know its input signature yet (a "
            "subclassed model never called). Train or call the wrapped model on a batch first.")
    tf.saved_model.save(model, directory)
