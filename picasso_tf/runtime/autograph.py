"""picasso_tf's own code runs in a traced step as Keras' does: called as written, not
converted by autograph.

Inside a tf.function, autograph converts every function it is called through unless
the function's module is on its list of modules left alone (tensorflow and keras are).
picasso_tf's step code (train_step, the rewritten forward pass, the fetch of rows, the
fused update) has no control flow on tensors, so converting it only added to each trace:
the conversion of every function on its first call, and a wrapper around every call.
Called unconverted, it keeps the step's conversion status, so the user's code that
Keras calls for it (layers' `call`, losses, metrics) is converted as before, and a
model's own Keras steps are called as written, as Keras calls them."""
from tensorflow.python.autograph.core import config, config_lib

_RULE = config_lib.DoNotConvert("picasso_tf")


def leave_picasso_tf_unconverted():
    """Adds picasso_tf to autograph's modules left alone (once)."""
    if not any(str(rule) == str(_RULE) for rule in config.CONVERSION_RULES):
        config.CONVERSION_RULES = (_RULE,) + tuple(config.CONVERSION_RULES)
