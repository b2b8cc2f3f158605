"""TableMirror: rank 0 sends the followers, with each batch, the index-table entries that
batch's forward reads (its ``req_to_token`` rows, the full→SWA map at the slots they name)
that differ from what the followers hold — never a pass over the whole table for a batch
that reads a small part of it. (That the follower's attention then reads the very slots
rank 0 reads: test_engine_tp.)"""

from types import SimpleNamespace

import torch

from actors.engine.tp_worker import TableMirror, apply_table_updates


def mirror_batch(rows, seq_lens, out_cache_loc=()):
    """What TableMirror reads of a ForwardBatch."""
    return SimpleNamespace(req_pool_indices=torch.tensor(rows), seq_lens=torch.tensor(seq_lens),
                           seq_lens_cpu=list(seq_lens), out_cache_loc=torch.tensor(out_cache_loc, dtype=torch.int64))


def test_table_mirror_sends_only_changed_entries():
    leader, follower = torch.zeros(4, 8, dtype=torch.int32), torch.zeros(4, 8, dtype=torch.int32)
    mirror = TableMirror({"req_to_token": leader})
    leader[1, :3] = torch.tensor([5, 6, 7], dtype=torch.int32)
    leader[3, 7] = 9
    updates = mirror.updates(mirror_batch([1, 3], [3, 8]))
    assert [u[1].tolist() for u in updates] == [[8, 9, 10, 31]]
    apply_table_updates({"req_to_token": follower}, updates)
    assert torch.equal(leader, follower)
    leader[1, 1] = 4  # a row re-pointed at cached slots
    apply_table_updates({"req_to_token": follower}, mirror.updates(mirror_batch([1], [3])))
    assert torch.equal(leader, follower) and mirror.updates(mirror_batch([1, 3], [3, 8])) == []
    assert mirror.updates(None) == []  # a sync without a forward: nothing reads the tables
    leader[0, 2], leader[2, 5] = 3, 4
    updates = mirror.updates(mirror_batch([0, 1, 2], [8, 3, 8]))  # most of the table: one pass over all of it
    assert [u[1].tolist() for u in updates] == [[2, 21]]


def test_table_mirror_sends_what_a_batch_reads_and_only_that():
    """Only the batch's rows ``[0, max seq_len)`` are compared, not the whole table, and the
    full→SWA map at the slots they and ``out_cache_loc`` name. A row written while in no
    batch (re-pointed at cached slots, reused after a retraction) stays stale on the
    followers until a batch reads it, then arrives whole: prefix included."""
    leader = {"req_to_token": torch.zeros(4, 8, dtype=torch.int32),
              "full_to_swa_index_mapping": torch.zeros(24, dtype=torch.int64)}
    follower = {name: t.clone() for name, t in leader.items()}
    table, mapping = leader["req_to_token"], leader["full_to_swa_index_mapping"]
    mirror = TableMirror(leader)
    table[0, :3] = torch.tensor([5, 6, 17], dtype=torch.int32)
    table[2, :4] = torch.tensor([11, 12, 13, 14], dtype=torch.int32)  # row 2 is in no batch yet
    mapping[[5, 6, 11, 12, 13, 14, 17, 20]] = torch.tensor([7, 8, 1, 2, 3, 4, 9, 10])
    apply_table_updates(follower, mirror.updates(mirror_batch([0], [3], out_cache_loc=[20])))
    assert torch.equal(follower["req_to_token"][0], table[0])
    assert follower["req_to_token"][2].tolist() == [0] * 8  # not read: not sent
    assert follower["full_to_swa_index_mapping"].nonzero().squeeze(1).tolist() == [5, 6, 17, 20]
    table[2, :2] = table[0, :2]  # re-pointed at row 0's cached slots, still in no batch
    mapping[[11, 20]] = 0  # (freed)
    table[2, 4] = 21
    mapping[21] = 11
    apply_table_updates(follower, mirror.updates(mirror_batch([2, 0], [5, 3], out_cache_loc=[21])))
    read = table[[2, 0], :5].long()
    assert torch.equal(follower["req_to_token"][[2, 0], :5], table[[2, 0], :5])
    assert torch.equal(follower["full_to_swa_index_mapping"][read], mapping[read])
    assert follower["full_to_swa_index_mapping"][20] == 10  # stale: this batch does not name slot 20
    for name in leader:  # ``sent`` is what the followers hold
        assert torch.equal(follower[name], mirror.sent[name])
