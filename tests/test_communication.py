"""The shapes that travel with the statistics' all-gather: the device predicate
(``communication.shapes_agree``, no host sync) and the host check (``check_shapes``, a
``ValueError``) decide alike, from the gathered shapes alone, for the log-prob ops' vocabulary
ranges; the global vocabulary is the last rank's stop."""

import pytest
import torch

from vocab_parallel_loss import communication

K, N = 5, 3  # the log-prob statistics of three tokens

# (columns, (start, stop)) per rank, and whether they tile the vocabulary
CASES = [
    ([(7, (0, 7)), (7, (7, 14))], True),
    ([(7, (0, 7)), (7, (7, 11))], True),  # the last rank padded
    ([(7, (0, 7)), (5, (7, 12)), (6, (12, 12))], True),  # unequal columns; a rank of padding
    ([(7, (0, 7)), (7, (8, 14))], False),  # a gap
    ([(7, (0, 7)), (7, (6, 13))], False),  # an overlap
    ([(7, (1, 7)), (7, (7, 14))], False),  # not from 0
    ([(7, (0, 7)), (7, (7, 16))], False),  # past the rank's columns
    ([(7, (0, 7)), (7, (9, 7))], False),  # stop before start
    ([(7, (0, 7)), (8, (8, 16))], False),  # equal shards that differ in width
]


def gathered(ranks, rows=(0, 0)):
    out = torch.randn(len(ranks), communication.stats_size(K, N))
    for r, (cols, (start, stop)) in enumerate(ranks):
        send = torch.zeros(communication.stats_size(K, N))
        communication.put_shapes(send, K, N, (cols, *rows, start, stop))
        out[r, K * N:] = send[K * N:]
    return out


@pytest.mark.parametrize("ranks,tiles", CASES)
def test_ranges_device_and_host_agree(ranks, tiles, monkeypatch):
    g = gathered(ranks)
    for r, (cols, (start, stop)) in enumerate(ranks):
        local = (cols, 0, 0, start, stop)
        assert bool(communication.shapes_agree(communication.gathered_shapes(g, K, N), local)) \
            == tiles
        monkeypatch.setattr(communication, "_verified_shapes", set())  # nothing verified before
        if tiles:
            communication.check_shapes(g, K, N, local, None)
        else:
            match = "vocab shards differ" if ranks[-1][0] == 8 else "vocab_range"
            with pytest.raises(ValueError, match=match):
                communication.check_shapes(g, K, N, local, None)
    if tiles:
        vocab = communication.gathered_vocab(communication.gathered_shapes(g, K, N))
        assert vocab.dtype == torch.int64 and int(vocab) == ranks[-1][1][1]


def test_sequence_rows_with_ranges(monkeypatch):
    monkeypatch.setattr(communication, "_verified_shapes", set())
    local = (7, 2, 2, 0, 7)
    ok = gathered([(7, (0, 7)), (7, (7, 14))], rows=(2, 2))
    assert bool(communication.shapes_agree(communication.gathered_shapes(ok, K, N), local))
    bad = ok.clone()
    bad[1, K * N + 1] = 3  # rank 1 holds one more row than the targets give it
    assert not bool(communication.shapes_agree(communication.gathered_shapes(bad, K, N), local))
    with pytest.raises(ValueError, match="sequence_parallel=True"):
        communication.check_shapes(bad, K, N, local, None)
