"""The requester's side of the row exchange (picasso_tf.distributed.exchange) for 3
ranks, in one process: what it sends each owner, and where each id finds its row among
the rows the owners send back. No collective runs here: the owners' replies are made
from what each was sent, as an owner serves them (one row per key, in the order sent).
The launches in test_horovod.py train through the whole exchange on 2 ranks."""
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
    members = [TableMember(tf.Variable(tf.zeros([rows, 2])), rows, 1.0) for rows in ROWS]
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
