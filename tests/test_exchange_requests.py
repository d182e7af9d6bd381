"""The row exchange (picasso_tf.distributed.exchange) for 3 ranks, in one process: what
the requester sends each owner, where each id finds its row among the rows the owners
send back, and what an owner serves for the keys every rank sent it. No collective
runs here: the owners' replies are made from what each was sent, as an owner serves
them (one row per key, in the order sent). The launches in test_horovod.py train
through the whole exchange on 2 ranks."""
import numpy as np
import pytest
import tensorflow as tf

from picasso_tf.distributed.exchange import RowExchange
from picasso_tf.distributed.world import World
from picasso_tf.embedding.row_keys import ID_BITS, row_id, table_number
from picasso_tf.embedding.sharded import RowShardedTables
from picasso_tf.program import ExchangedIds, TableLayout, TableMember

SIZE = 3
ROWS = (5, 7, 2, 9)     # blocks of 2, 3, 1 and 3 rows; the third table has fewer rows than ranks


def exchange(rank, check_ids):
    # Row i of table t holds (t, i).
    members = [TableMember(tf.Variable(np.stack([np.full(rows, t), np.arange(rows)], 1).astype(np.float32)), rows, 1.0)
               for t, rows in enumerate(ROWS)]
    world = World(SIZE, rank)
    storage = RowShardedTables(TableLayout("packed_float32_d2", 2, tf.float32, members), world)
    return RowExchange([storage], world, check_ids=check_ids), storage


def requests(seed):
    """Ids of each table (the first table read by two features), some repeated."""
    rng = np.random.default_rng(seed)
    tables = (0, 0, 1, 2, 3)
    return [(ExchangedIds("packed_float32_d2", t, f"ids{i}", f"feature{i}"),
             tf.constant(rng.integers(0, ROWS[t], (6, 2)), tf.int64)) for i, t in enumerate(tables)]


def reply(keys):
    """An owner's rows for the keys it was sent, in their order: each row names its key's
    table and id."""
    return tf.reshape(tf.cast(tf.stack([table_number(keys), tf.cast(row_id(keys), tf.int32)], 1), tf.float32), [-1])


@pytest.mark.parametrize("check_ids", [True, False])
@pytest.mark.parametrize("rank", [0, 2])
def test_each_owner_is_sent_its_distinct_keys_and_each_id_finds_its_row(rank, check_ids):
    ex, storage = exchange(rank, check_ids)
    sent = requests(seed=rank)
    by_owner, positions, counts, segments, bad = ex._request(storage, sent)
    assert (segments is not None) == check_ids     # checked ids' keys are cut owner by owner
    blocks = [-(-rows // SIZE) for rows in ROWS]
    for owner in range(SIZE):
        expected = sorted({(x.member << ID_BITS) | int(i) for x, ids in sent for i in ids.numpy().ravel()
                           if int(i) // blocks[x.member] == owner})
        assert sorted(by_owner[owner].numpy().tolist()) == expected
        assert len(set(by_owner[owner].numpy().tolist())) == len(expected) == int(counts[owner])
    fetched = tf.concat([reply(by_owner[owner]) for owner in range(SIZE)], 0)
    rows = ex._rows_of_groups(fetched, [counts], [segments])["packed_float32_d2"]
    for (x, ids), where in zip(sent, positions):
        assert where.shape == ids.shape
        found = tf.gather(rows, where).numpy()
        np.testing.assert_array_equal(found[..., 0], np.full(ids.shape, x.member))
        np.testing.assert_array_equal(found[..., 1], ids.numpy())


@pytest.mark.parametrize("rank", [0, 2])
def test_an_owner_serves_each_senders_ascending_keys_in_order_and_takes_their_gradients(rank):
    """Every rank's keys for one owner, as its AllToAllv delivers them (sender by sender):
    the lookup of each (sender, member) run as a site gives the rows, and the shards'
    gradients, of the lookup partitioned by member and stitched back."""
    ex, storage = exchange(rank, check_ids=True)
    sent = [exchange(sender, check_ids=True)[0]._request(exchange(sender, check_ids=True)[1], requests(seed=sender))[0]
            for sender in range(SIZE)]
    received = tf.concat([by_owner[rank] for by_owner in sent], 0)
    sender = tf.repeat(tf.range(SIZE), [int(tf.size(by_owner[rank])) for by_owner in sent])
    weights = tf.random.stateless_normal([int(tf.size(received)), 2], seed=[rank, 1])
    served = []
    for lookup in (lambda: ex._lookup_ascending(storage, received, sender), lambda: ex._lookup(storage, received)):
        with tf.GradientTape() as tape:
            rows = lookup()
            loss = tf.reduce_sum(rows * weights)
        # None for a shard no key reads (rank 2 holds no row of the 2-row table).
        served.append((rows.numpy(), [None if g is None else tf.convert_to_tensor(g).numpy()
                                      for g in tape.gradient(loss, storage.variables())]))
    (rows, grads), (expected_rows, expected_grads) = served
    np.testing.assert_array_equal(rows, expected_rows)
    np.testing.assert_array_equal(rows[:, 0], table_number(received).numpy())      # row i of table t is (t, i)
    np.testing.assert_array_equal(rows[:, 1], row_id(received).numpy())
    assert [g is None for g in grads] == [g is None for g in expected_grads]
    for got, want in zip(grads, expected_grads):
        if want is not None:
            np.testing.assert_allclose(got, want, rtol=1e-6)
