"""The multi-process test harness itself (tests/distributed.py): a flaky harness fails a whole CI run."""

from __future__ import annotations

import socket

import tests.distributed as harness


def _world_size(rank: int, world: int) -> int:
    import torch.distributed as dist

    return dist.get_world_size()


def test_ranks_meet_even_when_a_port_probed_free_is_taken_before_they_bind_it(monkeypatch):
    """Another test process may take the port between a probe and the ranks' bind (EADDRINUSE failed a CI run): the
    harness must not rely on a probed port staying free. The race made certain: the port the harness once probed with
    `free_port` is taken before the ranks start (the harness no longer has one, so that `raising=False`)."""
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        monkeypatch.setattr(harness, "free_port", lambda: taken.getsockname()[1], raising=False)
        assert harness.run_ranks(_world_size, 2) == [("ok", 2), ("ok", 2)]
    finally:
        taken.close()
