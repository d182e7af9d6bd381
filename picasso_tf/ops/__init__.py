"""Python wrappers of picasso_tf's custom ops and their gradients (library loaded once)."""
from picasso_tf.ops.library import OpsLibraryError, load
