"""Keras' train, test and predict functions called without their per-call dispatch.

Keras calls its step function (a tf.function) once per step with the data iterator.
Each call dispatches: TensorFlow builds the call's FunctionType from the iterator's
element spec, one TensorSpec per feature, hashes it to find the traced concrete
function, then binds the arguments to it. That costs time in proportion to the number
of feature fields, on every step: on a wide model of a few hundred fields it is a
noticeable part of a step that picasso_tf has made short (docs/benchmarks.md).

Within one iterator nothing the dispatch looks at can change (the element spec is the
iterator's), so DirectCalls asks for the concrete function and the call's flat
arguments once per iterator, at its second call (train_on_batch makes a new iterator
for every call, which keeps the ordinary call), and from then on calls the concrete
function with them: the same traced function, run on the same inputs and captures.
"""
import weakref

import tensorflow as tf
from tensorflow.python.eager.polymorphic_function import function_type_utils


class DirectCalls:
    """Calls `function` (a tf.function of one argument, the data iterator) as it is,
    then, from the second call with the same iterator on, its concrete function with
    the flat arguments found for that iterator (the module docstring)."""

    def __init__(self, function):
        self.function = function
        self._last = None         # a weak reference to the iterator of the last call
        self._bound = None        # (weak reference to an iterator, its concrete function, flat arguments)

    def __call__(self, iterator):
        bound = self._bound
        if bound is not None and bound[0]() is iterator:
            concrete, flat = bound[1], bound[2]
            return concrete._call_flat(flat, concrete.captured_inputs)   # what its own call runs
        if self._last is not None and self._last() is iterator:
            self._bind(iterator)
            return self(iterator)
        self._last = _weak(iterator)
        return self.function(iterator)

    def __getattr__(self, name):
        # Everything else is the tf.function's (get_concrete_function, tracing counts...);
        # Python's own protocols (copy, pickle) are not forwarded.
        if name.startswith("__") or name == "function":
            raise AttributeError(name)
        return getattr(self.function, name)

    def _bind(self, iterator):
        concrete = self.function.get_concrete_function(iterator)
        arguments = function_type_utils.canonicalize_function_inputs((iterator,), {}, concrete.function_type)
        self._bound = (self._last, concrete, concrete.function_type.unpack_inputs(arguments))
        # The flat arguments hold the iterator's resource: let it go with the iterator.
        weakref.finalize(iterator, self._forget, self._bound)

    def _forget(self, bound):
        if self._bound is bound:
            self._bound = None


def _weak(iterator):
    try:
        return weakref.ref(iterator)
    except TypeError:
        return lambda: None       # not weakly referable: never bound


def direct(function):
    """`function` called through DirectCalls where it is a tf.function (not under
    run_eagerly, nor a ClusterCoordinator's scheduling lambda); else itself."""
    if isinstance(function, tf.types.experimental.PolymorphicFunction):
        return DirectCalls(function)
    return function
