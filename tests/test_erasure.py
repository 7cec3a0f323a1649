"""P + Q parity (transport/erasure.py): any one or two lost chunks of a group come back exactly; three do not."""

import itertools

import numpy as np
import pytest

from halo.transport import erasure


def group(size, seed=0):
    rng = np.random.default_rng(seed)
    lengths = [1422] * (size - 1) + [int(rng.integers(1, 1423))]  # the vector's last chunk is shorter
    return [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in lengths]


@pytest.mark.parametrize("size", [1, 2, 6, 8, 33])
def test_any_two_lost_chunks_are_rebuilt(size):
    chunks = group(size, seed=size)
    p, q = erasure.parities(chunks)
    for lost in [(i,) for i in range(size)] + list(itertools.combinations(range(size), 2)):
        present = {i: c for i, c in enumerate(chunks) if i not in lost}
        rebuilt = erasure.rebuild(present, size, p, q)
        assert sorted(rebuilt) == list(lost)
        for i in lost:
            assert rebuilt[i][:len(chunks[i])] == chunks[i] and not any(rebuilt[i][len(chunks[i]):])


def test_one_parity_rebuilds_one_chunk_and_never_two():
    chunks = group(6)
    p, q = erasure.parities(chunks)
    present = {i: c for i, c in enumerate(chunks) if i != 4}
    assert erasure.rebuild(present, 6, p, None)[4][:1422] == chunks[4]  # P alone (Q lost)
    assert erasure.rebuild(present, 6, None, q)[4][:1422] == chunks[4]  # Q alone (P lost)
    two_lost = {i: c for i, c in enumerate(chunks) if i not in (1, 4)}
    assert erasure.rebuild(two_lost, 6, p, None) is None and erasure.rebuild(two_lost, 6, None, q) is None
    three_lost = {i: c for i, c in enumerate(chunks) if i not in (0, 1, 4)}
    assert erasure.rebuild(three_lost, 6, p, q) is None
    assert erasure.rebuild(dict(enumerate(chunks)), 6, p, q) == {}


def test_groups_are_bounded_by_the_field():
    with pytest.raises(ValueError, match="1 to 255"):
        erasure.parities([b"x"] * 256)


def test_parity_of_another_width_rebuilds_nothing():
    chunks = group(4)
    p, q = erasure.parities(chunks)
    present = {i: c for i, c in enumerate(chunks) if i != 0}
    assert erasure.rebuild(present, 4, p, q[:-1]) is None  # P and Q disagree: a forgery or a bug, never a guess
    assert erasure.rebuild(present, 4, p[:100], None) is None  # chunks longer than their parity


@pytest.mark.skipif(erasure._parities_in_c is None, reason="halo.transport._datagrams is not built (no C compiler at "
                                                            "install): numpy encodes, nothing to compare")
def test_the_c_encoder_gives_numpys_parity_bytes():
    """What every lossy vector is encoded with (C, 8 bytes at a time) against the table-driven reference, over group
    sizes, chunk lengths that are not whole words, and one or two parity chunks."""
    rng = np.random.default_rng(11)
    for size in (1, 2, 3, 5, 8, 17, 255):
        chunks = [rng.integers(0, 256, int(n), dtype=np.uint8).tobytes() for n in rng.integers(1, 1425, size)]
        for count in (1, 2):
            assert erasure.parities(chunks, count) == erasure.parities(chunks, count, native=False)
    assert erasure.parities([b"\x80" * 9, b"\x01"], 2) == erasure.parities([b"\x80" * 9, b"\x01"], 2, native=False)
