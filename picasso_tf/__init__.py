"""picasso_tf: PICASSO's packing, interleaving and caching for Keras recommendation models.

    import picasso_tf
    model = picasso_tf.optimize(model)       # or @picasso_tf.optimize(**options) on a builder
    model.compile(optimizer="adagrad", loss="binary_crossentropy")
    model.fit(dataset)                       # the same losses and weights as the plain model
    print(model.picasso.report())            # what was rewritten, and why anything was not

optimize      wraps a keras.Model (a PicassoModel, itself a keras.Model); options: Config
Config        every option, documented (docs/options.md is generated from it)
PicassoModel  the wrapped model; model.picasso holds the report, export, write_back
profile       op counts and graphs before/after on one batch (docs/profiling.md)
compile       the rewrite alone: a model to a Program, for tools

Guides: docs/getting-started.md, and one per capability in docs/; runnable scripts in
examples/.
"""
from picasso_tf.api import PicassoModel, optimize
from picasso_tf.compiler import compile_program as compile  # noqa: A001 (picasso_tf.compile, as the docs say)
from picasso_tf.config import Config
from picasso_tf.profiling.profile import profile
from picasso_tf.runtime.autograph import leave_picasso_tf_unconverted

leave_picasso_tf_unconverted()

__version__ = "0.1.0"
__all__ = ["optimize", "compile", "Config", "PicassoModel", "profile"]
