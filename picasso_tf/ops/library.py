"""Loads the custom-op library (custom_ops/*.cc built by setup.py) exactly once."""
import json
import os
import threading

import tensorflow as tf

_HERE = os.path.dirname(os.path.abspath(__file__))
_REBUILD = ("rebuild it with `pip install -e . --no-build-isolation` (or "
            "`python setup.py build_ext --inplace --force`) in the picasso_tf checkout")
_lock = threading.Lock()
_library = None


class OpsLibraryError(RuntimeError):
    """The compiled op library is missing, stale or does not load."""


def library_path():
    """Where the library is looked for; PICASSO_OPS_LIBRARY overrides (for development)."""
    return os.environ.get("PICASSO_OPS_LIBRARY", os.path.join(_HERE, "_picasso_ops.so"))


def load():
    """Returns the loaded op module (tf.load_op_library), loading it on first use."""
    global _library
    with _lock:
        if _library is None:
            _library = _load_checked(library_path())
        return _library


def _load_checked(path):
    if not os.path.exists(path):
        raise OpsLibraryError(f"picasso_tf's custom-op library is missing: {path} does not exist; {_REBUILD}.")
    info_path = os.path.join(os.path.dirname(path), "_build_info.json")
    if os.path.exists(info_path):
        with open(info_path) as f:
            built_for = json.load(f).get("tensorflow_version")
        if built_for != tf.__version__:
            raise OpsLibraryError(
                f"picasso_tf's custom-op library {path} was built against TensorFlow {built_for}, "
                f"but TensorFlow {tf.__version__} is installed; {_REBUILD}.")
    try:
        return tf.load_op_library(path)
    except tf.errors.NotFoundError as e:
        raise OpsLibraryError(
            f"picasso_tf's custom-op library {path} does not load into TensorFlow {tf.__version__} "
            f"({e}); {_REBUILD}.") from e
