"""The model zoo: the PICASSO paper's models in plain Keras (no picasso_tf code inside).

    import picasso_tf.models as zoo
    zoo.list()                          # ['lr', 'wide_deep', ..., 'atbrg']
    build = zoo.get("din")              # build_din(schema, **hparams) -> keras.Model
    zoo.info("din").needs               # ('behaviour',): what the schema must have
    zoo.missing_inputs("din", schema)   # [] or human-readable reasons
    result = zoo.build_and_train("din", train, test)   # the default short training

Every builder returns an *uncompiled* functional keras.Model over schema.keras_inputs()
that outputs click probabilities [B, 1] named after the label (MMoE: one output per
label). Each model module also carries TRAINING, its default short-training recipe,
and META (paper, needs, description); see models/README.md for the table.
"""
import builtins
import dataclasses
import importlib
from typing import Callable, Optional, Tuple

from picasso_tf.models import inputs as _inputs

NAMES = ("lr", "wide_deep", "deepfm", "dlrm", "dcn", "dcn_v2", "xdeepfm", "two_tower", "mmoe",
         "star", "din", "dien", "dsin", "can", "atbrg")

NEEDS = {
    "behaviour": "a behaviour sequence: a sequence feature whose `group` is shared by a one-hot "
                 "categorical feature (e.g. 'hist_item' with group='item' next to 'item' with "
                 "group='item')",
    "domain": "a one-hot categorical feature to serve as the domain indicator (hparam domain_feature)",
    "target": "a one-hot categorical feature to induce co-action (the target item; hparam "
              "target_feature, or the target of a behaviour pair)",
}


@dataclasses.dataclass(frozen=True)
class ModelInfo:
    name: str
    builder: Callable
    paper: str
    needs: Tuple[str, ...]
    description: str
    training: dict                      # the default short-training recipe
    prepare: Optional[Callable] = None  # prepare(schema, train_features) -> extra hparams

    def build(self, schema, **hparams):
        return self.builder(schema, **hparams)


def _load(name):
    module = importlib.import_module(f"picasso_tf.models.{name}")
    meta = module.META
    return ModelInfo(name=name, builder=getattr(module, f"build_{name}"), paper=meta["paper"],
                     needs=tuple(meta["needs"]), description=meta["description"],
                     training=dict(module.TRAINING), prepare=getattr(module, "prepare", None))


_REGISTRY = {name: _load(name) for name in NAMES}


def _unknown(name):
    return ValueError(f"unknown model {name!r}; the zoo has: {', '.join(NAMES)}")


def list():  # noqa: A001  (the registry's public name)
    """Names of the zoo's models, in the paper's order."""
    return builtins.list(NAMES)


def info(name) -> ModelInfo:
    """Metadata of one model: builder, paper, needs, description, training recipe."""
    key = name.lower().replace("-", "_") if isinstance(name, str) else name
    try:
        return _REGISTRY[key]
    except (KeyError, TypeError):
        raise _unknown(name) from None


def get(name):
    """The builder of a model: builder(schema, **hparams) -> uncompiled keras.Model."""
    return info(name).builder


def build(name, schema, **hparams):
    """Checks the schema against the model's needs, then builds it."""
    check(name, schema)
    return info(name).build(schema, **hparams)


def missing_inputs(name, schema):
    """What the schema lacks for this model, as readable sentences ([] when it has all)."""
    meta = info(name)
    missing = []
    if not schema.features:
        missing.append("at least one feature")
    if "behaviour" in meta.needs and not _inputs.behaviour_pairs(schema):
        missing.append(NEEDS["behaviour"])
    for need in ("domain", "target"):
        if need in meta.needs and not schema.categorical:
            missing.append(NEEDS[need])
    if name == "two_tower" and len(schema.features) < 2:
        missing.append("at least two features (one per tower)")
    return missing


def check(name, schema):
    """Raises ValueError naming what the schema lacks for this model."""
    missing = missing_inputs(name, schema)
    if missing:
        raise ValueError(f"model {name!r} cannot run on schema {schema.name!r}: it needs "
                         + "; ".join(missing))


def compatible(schema):
    """Names of the models that can run on this schema."""
    return [n for n in NAMES if not missing_inputs(n, schema)]


from picasso_tf.models.training import (  # noqa: E402  (needs the registry above)
    TrainResult, auc, build_and_train, compile_model, evaluate, fit, recipe)

__all__ = ["NAMES", "ModelInfo", "list", "info", "get", "build", "missing_inputs", "check",
           "compatible", "TrainResult", "auc", "build_and_train", "compile_model", "evaluate",
           "fit", "recipe"]
