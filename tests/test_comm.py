"""Collectives outside the links: large transfers to one rank, in pieces, from every sender at once."""

import pytest
import torch

from aqpipe.config.rates import MIN_RATE_BITS
from aqpipe.pipeline import comm
from tests.distributed import run_ranks


@pytest.mark.parametrize("stall_timeout, senders", [(300.0, 3), (300.0, 7), (6.0, 3), (60.0, 1)])
def test_a_round_of_pieces_crosses_the_slowest_link_within_half_the_time_out(stall_timeout, senders):
    piece = comm.piece_bytes(stall_timeout, senders)
    assert comm.MIN_PIECE <= piece <= comm.MAX_PIECE
    if comm.MIN_PIECE < piece < comm.MAX_PIECE:
        round_seconds = senders * piece * 8 / MIN_RATE_BITS
        assert 0.45 * stall_timeout < round_seconds <= 0.5 * stall_timeout


def test_pieces_stay_within_their_bounds():
    assert comm.piece_bytes(0.5, 16) == comm.MIN_PIECE  # (a round trip per 64 KiB at the least)
    assert comm.piece_bytes(1e6, 1) == comm.MAX_PIECE


PIECE = 1000
SIZES = {1: 0, 2: 999, 3: 4 * PIECE + 1}  # nothing, less than a piece, pieces and a remainder


def _payload(rank: int) -> bytes:
    return bytes((rank * 31 + i) % 251 for i in range(SIZES[rank]))


def _transfer(rank: int, world: int) -> tuple[list[bytes], list[tuple[int, int]]] | None:
    if rank != 0:
        comm.send_bytes(_payload(rank), 0, comm.FINAL_WEIGHTS, torch.device("cpu"), PIECE)
        return None
    rounds: list[tuple[int, int]] = []
    received = comm.receive_bytes_from_all([3, 1, 2], torch.device("cpu"), PIECE,
                                           lambda done, total: rounds.append((done, total)))
    return received, rounds


def test_every_sender_bytes_arrive_whole_in_rounds_of_one_piece_each():
    results = run_ranks(_transfer, 4)
    assert all(status == "ok" for status, _ in results), results
    received, rounds = results[0][1]
    assert received == [_payload(3), _payload(1), _payload(2)]  # in the order the sources were named
    total = sum(SIZES.values())
    # round 1 takes a piece from rank 3 and rank 2's 999 bytes; then one piece of rank 3's a round
    assert rounds == [(PIECE + 999, total), (2 * PIECE + 999, total), (3 * PIECE + 999, total),
                      (4 * PIECE + 999, total), (total, total)]
