"""picasso_tf: PICASSO's packing, interleaving and caching for Keras recommendation models.

    import picasso_tf as picasso
    model = picasso.optimize(model)          # or @picasso.optimize() on a builder
    print(model.picasso.report())
"""
from picasso_tf.api import PicassoModel, optimize
from picasso_tf.compiler import compile_program as compile  # noqa: A001 (picasso_tf.compile, as the docs say)
from picasso_tf.config import Config
from picasso_tf.profiling.profile import profile

__version__ = "0.1.0"
__all__ = ["optimize", "compile", "Config", "PicassoModel", "profile"]
