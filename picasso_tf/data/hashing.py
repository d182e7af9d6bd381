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
"""
import tensorflow as tf

HEX_DIGITS = 16   # fold_hex reads at most this many digits (a 64-bit value)


def _check_vocab(vocab_size):
    if int(vocab_size) < 2:
        raise ValueError(f"vocab_size must be >= 2 (id 0 is reserved for missing values), got {vocab_size}")
    return int(vocab_size)


def fold_hex(values, vocab_size):
    """int(value, 16) % (vocab_size - 1) + 1 for each hex string of 1..16 digits; "" -> 0.

    The caller validates the digits (readers do, with the error naming the line):
    any other byte gives an unspecified id.
    """
    modulus = _check_vocab(vocab_size) - 1
    values = tf.convert_to_tensor(values, tf.string)
    # Left-pad every string to exactly HEX_DIGITS characters so that decode_raw gives
    # a dense [..., 16] byte tensor.
    padded = tf.strings.substr(tf.strings.join(["0" * HEX_DIGITS, values]),
                               tf.strings.length(values), HEX_DIGITS)
    chars = tf.cast(tf.io.decode_raw(padded, tf.uint8), tf.int64)
    digits = tf.where(chars <= ord("9"), chars - ord("0"), tf.bitwise.bitwise_or(chars, 32) - (ord("a") - 10))
    # Horner's rule modulo `modulus` keeps every intermediate below 16 * modulus + 16.
    folded = tf.zeros_like(digits[..., 0])
    for i in range(HEX_DIGITS):
        folded = tf.math.floormod(folded * 16 + digits[..., i], modulus)
    return tf.where(values == "", tf.zeros_like(folded), folded + 1)


def hash_strings(values, vocab_size):
    """Fingerprint64(value) % (vocab_size - 1) + 1 for each string; "" -> 0."""
    buckets = _check_vocab(vocab_size) - 1
    values = tf.convert_to_tensor(values, tf.string)
    ids = tf.strings.to_hash_bucket_fast(values, buckets) + 1
    return tf.where(values == "", tf.zeros_like(ids), ids)
