"""The keys under which storage that fetches rows per step (the sharded and hash-backed
kinds) knows a row of a group: (table number << ID_BITS) | row id, int64, where the table
number counts the member tables of the groups fetched together.

A request is one site's ids (an ExchangedIds placeholder's value, any shape); `keys_of`
turns a group's requests into keys, checking that every id lies in its table (under
hybrid parallelism the exchange reports an invalid id to every rank instead:
``first_invalid``), and `positions_of` turns each key's place among the fetched rows
back into the requests' shapes, which the rewritten lookups read.

A dynamic vocabulary's keys are raw ids (any int64), which leave no bits for a table
number: under hybrid parallelism its rank is ``raw_key_owner``'s, and the exchange
sends them as pairs (``pairs``).
"""
import tensorflow as tf

ID_BITS = 40            # ids below 2**40; the table number takes the bits above
ID_MASK = (1 << ID_BITS) - 1


def select_rows(mask, *tensors):
    """Each tensor's rows (first dimension) where `mask`, a bool vector, is true, as
    tf.boolean_mask gives them, gathered at the indices of one Where shared by the
    tensors: tf.boolean_mask builds its own reshapes and Where per call, which made the
    traces of the hash-backed steps several times slower. One tensor or a list."""
    at = tf.reshape(tf.where(mask), [-1])
    selected = [tf.gather(t, at) for t in tensors]
    return selected[0] if len(selected) == 1 else selected


def check_table_count(tables):
    if tables >= 1 << (63 - ID_BITS):
        raise ValueError(f"picasso_tf: {tables} tables fetched together; at most {1 << (63 - ID_BITS)} can be")


def keys_of(layout, requests, first_table, check_ids=True):
    """The keys of every id of `requests` ([(ExchangedIds, ids)] of the group `layout`,
    whose member m is table number first_table + m), requests after one another, and
    the number of ids in each request."""
    flat = flat_ids([ids for _, ids in requests])
    if check_ids:
        flat = _checked(layout, requests, flat)
    return keys_of_ids(requests, flat, first_table), [tf.size(f) for f in flat]


def flat_ids(tensors):
    """Each tensor of ids as an int64 vector."""
    return [tf.reshape(tf.cast(ids, tf.int64), [-1]) for ids in tensors]


def keys_of_ids(requests, flat, first_table):
    """The keys of the requests' ids `flat` (flat_ids'), requests after one another."""
    return tf.concat([tf.bitwise.bitwise_or(ids, tf.constant((first_table + x.member) << ID_BITS, tf.int64))
                      for (x, _), ids in zip(requests, flat)], 0)


def widened(keys):
    """Keys as the exchange's pairs: [n, 2] int64 of (table number << ID_BITS, row id)."""
    return tf.stack([tf.bitwise.bitwise_and(keys, tf.constant(~ID_MASK, tf.int64)), row_id(keys)], 1)


def pairs(table, lookups, keys):
    """The exchange's pairs of raw keys: [n, 2] int64 of (table number << ID_BITS | how
    often the key was looked up, the key)."""
    tag = tf.bitwise.bitwise_or(tf.bitwise.left_shift(tf.cast(table, tf.int64), tf.constant(ID_BITS, tf.int64)),
                                tf.cast(lookups, tf.int64))
    return tf.stack([tag, tf.cast(keys, tf.int64)], 1)


def raw_key_owner(keys, size):
    """The rank (int32) holding each raw key of a dynamic vocabulary: its 64-bit
    fingerprint mod `size`, so that ids of one residue class (skewed, or all even)
    still spread over the ranks."""
    bits = tf.bitcast(tf.fingerprint(tf.reshape(tf.cast(keys, tf.int64), [-1])), tf.int64)
    return tf.cast(tf.math.floormod(bits, tf.constant(size, tf.int64)), tf.int32)


def positions_of(requests, place, sizes):
    """Each request's positions among the fetched rows, shaped and typed as its ids,
    from `place` (every key's position, requests after one another)."""
    parts = tf.split(place, sizes, num=len(sizes))
    return [tf.reshape(tf.cast(p, ids.dtype), tf.shape(ids)) for (_, ids), p in zip(requests, parts)]


def row_id(keys):
    return tf.bitwise.bitwise_and(keys, tf.constant(ID_MASK, tf.int64))


def table_number(keys):
    return tf.cast(tf.bitwise.right_shift(keys, tf.constant(ID_BITS, tf.int64)), tf.int32)


def first_invalid(rows, flat):
    """(whether an id of the requests `flat` (their ids, int64 vectors; `rows`: each
    one's table's rows) lies outside its table, the index of the first request holding
    one (int32), that id (int64)). One comparison per id; the index and the id are
    searched for only when there is one (else 0, 0)."""
    bad = tf.reduce_any(tf.stack([tf.reduce_any(_outside(f, r)) for f, r in zip(flat, rows)]))

    def find():
        ids = tf.concat(flat, 0)
        limit = tf.concat([tf.fill([tf.size(f)], tf.constant(r, tf.int64)) for f, r in zip(flat, rows)], 0)
        site = tf.concat([tf.fill([tf.size(f)], i) for i, f in enumerate(flat)], 0)
        first = tf.argmax(tf.cast(_outside(ids, limit), tf.int32), output_type=tf.int32)
        return tf.gather(site, first), tf.gather(ids, first)

    site, value = tf.cond(bad, find, lambda: (tf.constant(0), tf.constant(0, tf.int64)))
    return bad, site, value


def _outside(ids, rows):
    """ids < 0 or ids >= rows (int64 ids, rows >= 0), in one comparison: read as unsigned,
    a negative id is above any row count."""
    return tf.bitcast(ids, tf.uint64) >= tf.cast(rows, tf.uint64)


def invalid_id_message(features, limits, request, value, rank=None):
    """The data of a tf.debugging.Assert naming the feature of request number `request`
    (features, limits: per request, its feature and its table's rows), its id `value`
    outside [0, limit) and what to do; `rank`: the rank whose batch holds it, which
    every rank names (under hybrid parallelism)."""
    where = [] if rank is None else ["in the batch of rank", rank]
    every = "" if rank is None else "; every rank refused the step, and no table of any rank changed"
    return ["picasso_tf: ids of feature", tf.gather(tf.constant(features), request), "must lie in [0,",
            tf.gather(tf.constant(limits, tf.int64), request), "): got", value, *where,
            "; raise the feature's vocabulary size or hash its ids into that range" + every]


def _checked(layout, requests, flat):
    """The ids, with an error naming the feature and the id unless every id lies in
    its table (an id outside would be fetched from a wrong row). The message is
    assembled only when it fails."""
    rows = [layout.members[x.member].rows for x, _ in requests]
    bad, request, value = first_invalid(rows, flat)

    def fail():
        message = invalid_id_message([x.feature for x, _ in requests], rows, request, value)
        with tf.control_dependencies([tf.debugging.Assert(False, message, summarize=1)]):
            return tf.constant(False)

    checked = tf.cond(bad, fail, lambda: tf.constant(True))
    with tf.control_dependencies([checked]):
        return [tf.identity(f) for f in flat]
