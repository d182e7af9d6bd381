"""Build + compile + train + evaluate a zoo model with its default short-training recipe.

`build_and_train` is the one entry point the quality checks, benchmarks/zoo_quality.py
and later the "with picasso_tf.optimize" variants share: pass `wrap=` to transform the
built model (e.g. `wrap=picasso.optimize`) before it is compiled and trained.

Data: anything with `.schema`, `.features` ({name: numpy array}) and `.label_dict`
({label: float32 [N]}) or `.labels`, i.e. picasso_tf.data.TabularData; when it has
`.dataset(batch_size, shuffle, seed, repeat)` (TabularData does) training reads that
tf.data pipeline, else numpy arrays go to model.fit directly.
"""
import dataclasses
import math
import time
from typing import Callable, Dict, Optional

import numpy as np
import tensorflow as tf

from picasso_tf.api import PicassoModel

OPTIMIZERS = {"adam": tf.keras.optimizers.Adam, "adagrad": tf.keras.optimizers.Adagrad,
              "sgd": tf.keras.optimizers.SGD, "rmsprop": tf.keras.optimizers.RMSprop,
              "ftrl": tf.keras.optimizers.Ftrl}


@dataclasses.dataclass
class TrainResult:
    name: str
    model: tf.keras.Model
    recipe: dict
    history: dict
    auc: Dict[str, float]          # test AUC per label ({} without test data)
    train_seconds: float

    @property
    def test_auc(self):
        """The AUC of the first label (the only one for single-task models)."""
        return next(iter(self.auc.values())) if self.auc else float("nan")


def recipe(name, **overrides):
    """The model's TRAINING recipe with overrides (None values are ignored)."""
    from picasso_tf import models as zoo
    out = dict(zoo.info(name).training)
    out.update({k: v for k, v in overrides.items() if v is not None})
    return out


def _label_dict(data):
    if hasattr(data, "label_dict"):
        return dict(data.label_dict)
    labels = data.labels
    return dict(labels) if isinstance(labels, dict) else {data.schema.labels[0]: labels}


def output_names(model):
    return list(model.output_names)


def compile_model(model, recipe):
    """Compiles with the recipe's optimizer, binary cross-entropy and AUC per output."""
    opt = OPTIMIZERS[recipe["optimizer"]](learning_rate=recipe["learning_rate"])
    model.compile(optimizer=opt, loss="binary_crossentropy", metrics=[tf.keras.metrics.AUC(name="auc")])
    build_optimizer(model)
    return model


def build_optimizer(model):
    """Creates the compiled optimizer's slots for the model's trainable variables now, as
    Keras would in the first training step. Created there, they make tf.function trace
    the step a second time (a step's graph may create variables only on its first
    trace), which doubles the first step's cost; the values are the same either way (a
    variable no loss reaches gets slots Keras would not make, never updated).
    Left to Keras where the slots could differ or are not known yet: a model not built
    yet, one with its own train_step, a loss-scaled optimizer. A PicassoModel builds its
    optimizer itself, the same way."""
    optimizer = model.optimizer
    if (isinstance(model, PicassoModel) or not model.built or type(model).train_step is not tf.keras.Model.train_step
            or not isinstance(optimizer, tf.keras.optimizers.Optimizer)
            or isinstance(optimizer, tf.keras.mixed_precision.LossScaleOptimizer)):
        return
    with tf.init_scope(), tf.name_scope(optimizer.name or "optimizer"):
        optimizer.build(model.trainable_variables)


def _targets(model, labels):
    names = output_names(model)
    missing = [n for n in names if n not in labels]
    if missing:
        raise ValueError(f"model outputs {missing} have no label in the data (labels: {sorted(labels)})")
    return labels[names[0]] if len(names) == 1 else {n: labels[n] for n in names}


def fit(model, data, recipe, seed=0, verbose=0, callbacks=None):
    """Trains `epochs` epochs of `batch_size` on data; returns the Keras history dict."""
    names = output_names(model)
    bs, epochs = int(recipe["batch_size"]), int(recipe["epochs"])
    if hasattr(data, "dataset"):
        steps = math.ceil(len(next(iter(_label_dict(data).values()))) / bs)
        ds = data.dataset(bs, shuffle=True, seed=seed, repeat=True)
        if len(names) == 1:
            ds = ds.map(lambda x, y: (x, y[names[0]] if isinstance(y, dict) else y))
        elif len(names) != len(data.schema.labels):
            ds = ds.map(lambda x, y: (x, {n: y[n] for n in names}))
        hist = model.fit(ds, epochs=epochs, steps_per_epoch=steps, verbose=verbose, callbacks=callbacks)
    else:
        hist = model.fit(dict(data.features), _targets(model, _label_dict(data)), batch_size=bs,
                         epochs=epochs, shuffle=True, verbose=verbose, callbacks=callbacks)
    return hist.history


def predict(model, features, batch_size=4096):
    """{output name: probabilities [N]}."""
    out = model.predict(dict(features), batch_size=batch_size, verbose=0)
    names = output_names(model)
    if not isinstance(out, dict):
        out = {names[0]: out} if len(names) == 1 else dict(zip(names, out))
    return {k: np.asarray(v).reshape(-1) for k, v in out.items()}


def evaluate(model, data, batch_size=4096):
    """{label: test AUC} for every model output that has a label in data."""
    labels = _label_dict(data)
    scores = predict(model, data.features, batch_size)
    return {n: auc(labels[n], s) for n, s in scores.items() if n in labels}


def auc(labels, scores):
    """ROC AUC, ties counted as half (picasso_tf.data.roc_auc); NaN with one class only."""
    from picasso_tf.data.metrics import roc_auc
    labels = np.asarray(labels).reshape(-1)
    if (labels > 0.5).all() or (labels <= 0.5).all():
        return float("nan")
    return roc_auc(labels, scores)


def build_and_train(name, train, test=None, hparams=None, seed=0, wrap: Optional[Callable] = None,
                    verbose=0, callbacks=None, **recipe_overrides):
    """Builds zoo model `name` for train.schema, trains it with its recipe, evaluates on test.

    hparams go to the builder (after the model's `prepare(schema, train.features)` ones,
    e.g. ATBRG's graph); recipe_overrides (epochs=, batch_size=, learning_rate=,
    optimizer=) change the recipe; `wrap(model) -> model` runs between build and compile.
    """
    from picasso_tf import models as zoo
    meta = zoo.info(name)
    rec = recipe(name, **recipe_overrides)
    schema = train.schema
    zoo.check(name, schema)
    tf.keras.utils.set_random_seed(seed)
    params = dict(meta.prepare(schema, train.features)) if meta.prepare else {}
    params.update(hparams or {})
    model = meta.builder(schema, **params)
    if wrap is not None:
        model = wrap(model)
    compile_model(model, rec)
    start = time.perf_counter()
    history = fit(model, train, rec, seed=seed, verbose=verbose, callbacks=callbacks)
    seconds = time.perf_counter() - start
    aucs = evaluate(model, test) if test is not None else {}
    return TrainResult(name, model, rec, history, aucs, seconds)
