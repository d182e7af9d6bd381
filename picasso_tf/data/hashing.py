"""Stable mappings from raw categorical strings to ids in [1, vocab_size).

Both functions map the empty string (a missing value) to id 0, accept any string
tensor or numpy array, and give the same ids on every run and machine:

  fold_hex      the value of a hexadecimal string modulo (vocab_size - 1), plus 1.
                Criteo's categoricals are already 32-bit hashes written in hex, so
                folding their value keeps them uniform and is reproducible without
                TensorFlow: `int(s, 16) % (vocab_size - 1) + 1` (the DLRM convention,
                shifted by one because id 0 is reserved).
  hash_strings  FarmHash Fingerprint64 of the bytes modulo (vocab_size - 1), plus 1
                (tf.strings.to_hash_bucket_fast, whose output TensorFlow guarantees
                never to change), for arbitrary strings such as Avazu's columns.

fold_hex's vocab_size may be one int or one per column (the last axis).
"""
import numpy as np
import tensorflow as tf

HEX_DIGITS = 8   # fold_hex reads 32-bit values, as Criteo writes them
_DIGIT_OF_BYTE = np.array([int(chr(b), 16) if chr(b) in "0123456789abcdefABCDEF" else -1 for b in range(256)],
                          np.int64)
_PLACES = np.array([16 ** p for p in range(HEX_DIGITS - 1, -1, -1)], np.int64)


def _moduli(vocab_size):
    sizes = np.asarray(vocab_size, np.int64)
    if (sizes < 2).any():
        raise ValueError(f"vocab_size must be >= 2 (id 0 is reserved for missing values), got {vocab_size}")
    return sizes - 1


def parse_hex(values):
    """(value int64, valid bool) of each string of 1 to 8 hexadecimal digits.

    Works on the bytes (decode_raw) rather than with a regex or string padding, which
    cost ten times more. Invalid strings (empty, too long, other characters) get
    valid False and an unspecified value.
    """
    values = tf.convert_to_tensor(values, tf.string)
    length = tf.strings.length(values)
    chars = tf.cast(tf.io.decode_raw(values, tf.uint8, fixed_length=HEX_DIGITS), tf.int32)   # zero-padded
    digits = tf.gather(_DIGIT_OF_BYTE, chars)   # -1 for a non-digit
    in_string = tf.range(HEX_DIGITS) < length[..., None]
    # Left-aligned digits read as 8 hex places are value * 16^(8 - length): shift it back.
    left = tf.reduce_sum(tf.maximum(digits, 0) * _PLACES, axis=-1)
    value = tf.bitwise.right_shift(left, tf.cast(4 * (HEX_DIGITS - tf.minimum(length, HEX_DIGITS)), tf.int64))
    valid = (length >= 1) & (length <= HEX_DIGITS) & tf.reduce_all((digits >= 0) | ~in_string, axis=-1)
    return value, valid


def fold_hex_checked(values, vocab_size):
    """(ids, valid): the ids of fold_hex, and whether each string is empty or 1 to 8
    hexadecimal digits (ids of other strings are unspecified)."""
    values = tf.convert_to_tensor(values, tf.string)
    value, valid = parse_hex(values)
    empty = tf.equal(values, "")
    ids = tf.math.floormod(value, _moduli(vocab_size)) + 1
    return tf.where(empty, tf.zeros_like(ids), ids), valid | empty


def fold_hex(values, vocab_size):
    """int(value, 16) % (vocab_size - 1) + 1 for each hex string of 1..8 digits; "" -> 0."""
    return fold_hex_checked(values, vocab_size)[0]


def hash_strings(values, vocab_size):
    """Fingerprint64(value) % (vocab_size - 1) + 1 for each string; "" -> 0 (one vocab_size)."""
    buckets = int(_moduli(vocab_size))
    values = tf.convert_to_tensor(values, tf.string)
    ids = tf.strings.to_hash_bucket_fast(values, buckets) + 1
    return tf.where(values == "", tf.zeros_like(ids), ids)
