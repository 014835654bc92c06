"""Rank 0's outputs at the end of a run: the final weights' pieces."""

import pytest

from aqpipe.config.rates import MIN_RATE_BITS
from aqpipe.runtime.outputs.final_weights import MAX_PIECE, MIN_PIECE, piece_bytes


@pytest.mark.parametrize("stall_timeout, senders", [(300.0, 3), (300.0, 7), (6.0, 3), (60.0, 1)])
def test_a_round_of_pieces_crosses_the_slowest_link_within_a_third_of_the_time_out(stall_timeout, senders):
    """A piece's send waits for the rest of its round and its share of the next: under the time-out at 1 Mbit/s."""
    piece = piece_bytes(stall_timeout, senders)
    assert MIN_PIECE <= piece <= MAX_PIECE
    if MIN_PIECE < piece < MAX_PIECE:
        round_seconds = senders * piece * 8 / MIN_RATE_BITS
        assert 0.3 * stall_timeout < round_seconds <= stall_timeout / 3


def test_pieces_stay_within_their_bounds():
    assert piece_bytes(0.5, 16) == MIN_PIECE  # (a round trip per 64 KiB at the least)
    assert piece_bytes(1e6, 1) == MAX_PIECE
