"""Collectives outside the links: large transfers to one rank, in pieces, from every sender at once."""

import torch

from aqpipe.pipeline.world import comm
from tests.distributed import run_ranks

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


def test_each_senders_bytes_arrive_whole_in_rounds_of_one_piece_each():
    results = run_ranks(_transfer, 4)
    assert all(status == "ok" for status, _ in results), results
    received, rounds = results[0][1]
    assert received == [_payload(3), _payload(1), _payload(2)]  # in the order the sources were named
    total = sum(SIZES.values())
    # round 1 takes a piece from rank 3 and rank 2's 999 bytes; then one piece of rank 3's a round
    assert rounds == [(PIECE + 999, total), (2 * PIECE + 999, total), (3 * PIECE + 999, total),
                      (4 * PIECE + 999, total), (total, total)]
