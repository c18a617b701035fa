"""``SavesOnTheirWay``: what a ``PageTransfer`` tells the budget about a save's parent."""
from __future__ import annotations

from gdskv.transfer import SaveStatus
from gdskv.transfer.lineage import SavesOnTheirWay

A, B, C = b"a" * 8, b"b" * 8, b"c" * 8


def test_a_chain_posted_in_one_step_is_on_its_way_up_to_the_block_above_it() -> None:
    w = SavesOnTheirWay()
    forget = w.post(0, [(B, A), (C, B)])
    assert w.lineage(0, C) == (A, [C, B])  # A must be stored; B and C are being written
    assert w.lineage(0, A) == (A, [])
    assert w.lineage(1, C) == (C, []), "layer groups are apart"
    forget([1, 0], [SaveStatus.PUBLISHED, SaveStatus.EXISTS], [])
    assert len(w) == 0 and w.lineage(0, C) == (C, [])


def test_a_block_two_requests_post_stays_on_its_way_while_a_copy_is() -> None:
    w = SavesOnTheirWay()
    first = w.post(0, [(A, None)])
    second = w.post(0, [(A, None), (B, A)])
    w.refused(0, A)  # the first request's copy
    assert w.lineage(0, B) == (None, [B, A]), "the second copy of A is still to come"
    first([0], [SaveStatus.DROPPED], [])
    assert w.lineage(0, B) == (None, [B, A])
    w.refused(0, A)  # the second copy too: B's parent is not coming
    assert w.lineage(0, B) == (A, [B])
    second([0, 1], [SaveStatus.DROPPED, SaveStatus.PUBLISHED], [])
    assert len(w) == 0


def test_cancelled_copies_are_forgotten_and_settle_no_refusal() -> None:
    w = SavesOnTheirWay()
    first = w.post(0, [(A, None)])
    second = w.post(0, [(A, None)])
    w.refused(0, A)
    second([], [], [0])  # cancelled before it ran: not the refused copy
    assert w.lineage(0, A) == (A, []), "the one copy left was refused"
    first([0], None, [])  # its slice raised
    assert len(w) == 0
