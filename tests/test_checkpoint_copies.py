"""Copies of each rank's checkpoint part on other hosts (aqpipe.runtime.checkpoints.copies): where they go, that they
arrive whole and checked, and that a host that lost its part gets it back from one."""

import datetime
import shutil
from pathlib import Path

import pytest
import torch

from aqpipe.runtime.checkpoints import parts as ck
from aqpipe.runtime.checkpoints.copies import Landing, copy_plan, default_copies
from aqpipe.runtime.checkpoints.restart import choose_start, holding
from tests.distributed import run_ranks
from tests.hosts import wipe

SETTINGS = {"model": "llama-tiny", "seed": 0}


def test_each_part_goes_to_the_first_rank_of_the_next_hosts():
    assert copy_plan(["a", "b", "c"], 1) == {0: [1], 1: [2], 2: [0]}
    assert copy_plan(["a", "a", "b", "b"], 1) == {0: [2], 1: [2], 2: [0], 3: [0]}  # never on its own host
    assert copy_plan(["a", "b", "c"], 2) == {0: [1, 2], 1: [2, 0], 2: [0, 1]}
    assert copy_plan(["a", "a"], 0) == {0: [], 1: []}
    with pytest.raises(ValueError, match="--checkpoint-replicas 2 needs 3 hosts, the ranks span 2"):
        copy_plan(["a", "b", "b"], 2)
    assert [default_copies(hosts, None) for hosts in (["a", "a"], ["a", "b"])] == [0, 1]
    assert default_copies(["a", "b"], 0) == 0


def test_a_damaged_copy_is_refused_not_kept(tmp_path):
    ck.save_rank(tmp_path / "source", 4, 1, {"model": {"w": torch.ones(8)}}, SETTINGS)
    part = ck.rank_file(ck.step_dir(tmp_path / "source", 4), 1)
    line = part.with_suffix(".sha256").read_text()
    with pytest.raises(RuntimeError, match="arrived damaged"):
        land(tmp_path / "holder", part.read_bytes()[:-1] + b"x", line)
    assert list(ck.step_dir(tmp_path / "holder", 4).iterdir()) == []  # (nor its piece-by-piece temporary file)
    land(tmp_path / "holder", part.read_bytes(), line)
    ck.check_rank(tmp_path / "holder", 4, 1, SETTINGS)  # (whole, and checked as the rank's own would be)


def land(out: Path, part: bytes, line: str) -> None:
    """Rank 1's part of step 4 arriving at `out` in pieces of 100 kB, then kept (or refused) and tidied."""
    landing = Landing(out, 4, 1, line)
    try:
        for lo in range(0, len(part), 100_000):
            landing.write(part[lo:lo + 100_000])
        landing.keep()
    finally:
        landing.discard()


def _copy(rank: int, world: int, root: str, link_rate: float = 1e9, keep_part: bool = False, group_timeout: float = 60):
    """On each of `world` hosts (one rank each, a directory each, a pipeline stage each): a checkpoint of step 4
    (`keep_part`: the one already there), then its copies, paced by the link rate the stage measured from the host
    before it, their group's collectives timing out after `group_timeout` seconds."""
    from aqpipe.pipeline.vocab.step_stats import StepStats
    from aqpipe.pipeline.world import comm
    from aqpipe.pipeline.world.grid import Grid
    from aqpipe.runtime.checkpoints.copier import CheckpointCopier

    out = Path(root) / f"host-{rank}"
    if not keep_part:
        ck.save_rank(out, 4, rank, {"model": {"w": torch.randn(100_000 * (rank + 1))}}, SETTINGS)
    ck.mark_complete(out, 4, world, SETTINGS)
    copier = CheckpointCopier(out, Grid(world, 1, rank), [f"host-{r}" for r in range(world)], 1,
                              datetime.timedelta(seconds=group_timeout), 0.1)
    copier.observe(StepStats(fwd_recv_bytes=int(link_rate), fwd_arrived_bytes=int(link_rate), fwd_recv_seconds=1.0,
                             bwd_recv_bytes=int(link_rate), bwd_arrived_bytes=int(link_rate), bwd_recv_seconds=1.0))
    copier.start(4, leader=True)
    copier.wait()
    copier.close()
    return comm.TRAFFIC.sent[comm.CHECKPOINT], sorted(p.name for p in ck.step_dir(out, 4).iterdir())


@pytest.fixture(scope="module")
def copied(tmp_path_factory):
    """Three hosts' directories after step 4's checkpoint and its copies (`_copy`), and each rank's result; a test
    that changes them takes its own copy (`hosts_after_copies`)."""
    root = tmp_path_factory.mktemp("copied")
    return root, run_ranks(_copy, 3, str(root))


def hosts_after_copies(copied, tmp_path: Path) -> Path:
    """A copy of the three hosts' directories after the copies, in `tmp_path`, the copies having succeeded."""
    root, results = copied
    assert all(status == "ok" for status, _ in results), results
    shutil.copytree(root, tmp_path, dirs_exist_ok=True)
    return tmp_path


def test_every_part_reaches_the_next_host_whole_and_the_step_is_marked_replicated(copied):
    tmp_path, results = copied
    for rank, (status, value) in enumerate(results):
        assert status == "ok", value
        sent, names = value
        assert sent == ck.rank_file(ck.step_dir(tmp_path / f"host-{rank}", 4), rank).stat().st_size
        copy = (rank - 1) % 3  # the part this host keeps for the host before it
        assert names == sorted(["COMPLETE", "COPYING", "REPLICATED", "run.json", f"rank-{rank}.pt",
                                f"rank-{rank}.sha256", f"rank-{copy}.pt", f"rank-{copy}.sha256"])
        ck.check_rank(tmp_path / f"host-{rank}", 4, copy, SETTINGS)


def test_copies_are_paced(tmp_path):
    """1.2 MB from the largest part at 400 kB/s (10% of a 4 MB/s link: `test_the_rate_counts_only_links_…`) takes
    3 s."""
    status, value = run_ranks(_timed_copy, 3, str(tmp_path))[2]
    assert status == "ok", value
    assert 2.5 <= value <= 6.0, value


def _timed_copy(rank: int, world: int, root: str):
    import time

    from aqpipe.runtime.checkpoints import copies

    out = Path(root) / f"host-{rank}"
    ck.save_rank(out, 4, rank, {"model": {"w": torch.randn(100_000 * (rank + 1))}}, SETTINGS)
    start = time.monotonic()
    copies.copy_step(out, 4, rank, copies.copy_plan([f"host-{r}" for r in range(world)], 1), None, 4e5)
    return time.monotonic() - start


def _recover(rank: int, world: int, root: str):
    from aqpipe.runtime.checkpoints import resume

    return resume.agreed_step(str(Path(root) / f"host-{rank}"), rank, SETTINGS, explicit=False)


def test_a_host_that_lost_its_part_fetches_it_from_a_copy_and_every_rank_continues(copied, tmp_path):
    hosts_after_copies(copied, tmp_path)
    lost = tmp_path / "host-1"
    wipe(lost)
    start = choose_start([holding(tmp_path / f"host-{r}", r, SETTINGS) for r in range(3)], tmp_path, explicit=False)
    assert start.candidates == [4]  # (rank 1's part is on host 2)
    assert [value for _, value in run_ranks(_recover, 3, str(tmp_path))] == [4, 4, 4]
    ck.check_rank(lost, 4, 1, SETTINGS)
    assert (ck.step_dir(lost, 4) / "COMPLETE").is_file() and (ck.step_dir(lost, 4) / "run.json").is_file()


def test_a_checkpoint_whose_copies_never_finished_counts_only_while_every_part_is_on_its_host(copied, tmp_path):
    """Step 8 was written everywhere but its copies were cut short (no REPLICATED): a restart continues from it while
    every part is still there; once a host lost its part of it, from step 4, whose copies finished."""
    hosts_after_copies(copied, tmp_path)
    hosts = [tmp_path / f"host-{r}" for r in range(3)]
    for rank, host in enumerate(hosts):
        ck.save_rank(host, 8, rank, {"model": {"w": torch.zeros(4)}}, SETTINGS)
        ck.mark_complete(host, 8, 3, SETTINGS)
        (ck.step_dir(host, 8) / "COPYING").write_bytes(b"")
    holdings = [holding(h, r, SETTINGS) for r, h in enumerate(hosts)]
    assert choose_start(holdings, tmp_path, explicit=False).candidates[0] == 8
    ck.rank_file(ck.step_dir(hosts[1], 8), 1).unlink()
    holdings = [holding(h, r, SETTINGS) for r, h in enumerate(hosts)]
    assert choose_start(holdings, tmp_path, explicit=False).candidates == [4]


def test_a_host_that_lost_its_part_of_a_checkpoint_kept_without_copies_stops_every_rank_with_one_line(tmp_path):
    """--checkpoint-replicas 0 across hosts: step 4 is complete on every host and kept nowhere else. A host that comes
    back with an empty disk has nothing to fetch, and no rank trains over the run: the start is refused, naming the
    rank that lost its part and where to put the files back."""
    hosts = [tmp_path / f"host-{r}" for r in range(3)]
    for rank, host in enumerate(hosts):
        ck.save_rank(host, 4, rank, {"model": {"w": torch.full((4,), float(rank))}}, SETTINGS)
        ck.mark_complete(host, 4, 3, SETTINGS)
    assert choose_start([holding(h, r, SETTINGS) for r, h in enumerate(hosts)], tmp_path, explicit=False
                        ).candidates == [4]
    wipe(hosts[1])
    for explicit in (False, True):
        with pytest.raises(ck.CheckpointError, match=r"^the checkpoint of step 4 is complete, but rank 1 on \S+ no longer "
                                                  r"holds its part of it and no host keeps a copy \(a lost disk\?\); put "
                                                  r"the files back under .*step-00000004, or start again with --overwrite$"):
            choose_start([holding(h, r, SETTINGS) for r, h in enumerate(hosts)], tmp_path, explicit=explicit)


def test_a_copy_is_paced_by_the_kernel_packet_by_packet_or_else_in_pieces_that_cross_the_link_in_milliseconds():
    """Where Linux paces a socket (SO_MAX_PACING_RATE), a copy's stream is sent at its rate packet by packet. Elsewhere
    its sender sends what the pace sends in PIECE_SECONDS at a time: at the default share of the link (0.05), 1/400 s
    of the link's own time, so a step's messages queued behind a piece on a shaped link wait milliseconds (1 MiB pieces cost a
    SmolLM2 step over 100 Mbit/s links 15%); never below 64 KiB, never above 1 MiB, 1 MiB unpaced."""
    import socket
    import sys

    from aqpipe.runtime.checkpoints.copies import CHUNK_BYTES, MIN_PIECE_BYTES, SO_MAX_PACING_RATE, pace, piece_bytes

    with socket.socket() as stream:
        assert pace(stream, 1.25e6) == sys.platform.startswith("linux")
        if sys.platform.startswith("linux"):
            assert stream.getsockopt(socket.SOL_SOCKET, SO_MAX_PACING_RATE) == 1_250_000
    assert piece_bytes(None) == CHUNK_BYTES == 1 << 20
    assert piece_bytes(2e6) == 100_000
    assert piece_bytes(1e5) == MIN_PIECE_BYTES and piece_bytes(1e9) == CHUNK_BYTES


def _copy_with_a_full_disk_on_host_1(rank: int, world: int, root: str):
    """Each host's part of step 4 exchanged (`copy_step`), with host 1's disk full: writing the copy it keeps fails at
    its second piece. Rank 0's part, 16 MB, is more than the sockets' buffers hold: had host 1 stopped reading, rank
    0 would wait for it and time out (10 s here)."""
    import time

    from aqpipe.runtime.checkpoints import copies

    out = Path(root) / f"host-{rank}"
    ck.save_rank(out, 4, rank, {"model": {"w": torch.randn(4_000_000 if rank == 0 else 100_000)}}, SETTINGS)
    if rank == 1:
        written = []

        def full(self, data):
            written.append(len(data))
            if len(written) > 1:
                raise OSError(28, "No space left on device")

        copies.Landing.write = full
    start = time.monotonic()
    try:
        copies.copy_step(out, 4, rank, copies.copy_plan([f"host-{r}" for r in range(world)], 1), None, 4e7,
                         timeout=10)
        problem = ""
    except RuntimeError as e:
        problem = str(e)
    return time.monotonic() - start, problem, sorted(p.name for p in ck.step_dir(out, 4).iterdir())


def test_a_host_that_cannot_keep_a_copy_goes_on_reading_it_so_no_other_waits(tmp_path):
    """A rank that failed to keep what it received reads the rest of it, so no sender waits for a reader that never
    comes; every rank's copy ends at once, the others keep theirs, it keeps nothing."""
    results = run_ranks(_copy_with_a_full_disk_on_host_1, 3, str(tmp_path))
    for rank, (status, value) in enumerate(results):
        assert status == "ok", value
        seconds, problem, names = value
        assert seconds < 8, (rank, seconds)
        assert not [n for n in names if n.startswith(".")]  # (no temporary file left)
        assert problem == ("keeping a copy: [Errno 28] No space left on device" if rank == 1 else ""), rank
    assert "rank-0.pt" not in results[1][1][2] and "rank-1.pt" in results[2][1][2]


def _copy_a_part_damaged_on_host_1(rank: int, world: int, root: str):
    """`_copy`, with host 1's part damaged on its disk after its checksum was written."""
    import time

    out = Path(root) / f"host-{rank}"
    if rank == 1:
        ck.save_rank(out, 4, rank, {"model": {"w": torch.randn(200_000)}}, SETTINGS)
        part = ck.rank_file(ck.step_dir(out, 4), rank)
        part.write_bytes(part.read_bytes()[:-100] + bytes(100))
    start = time.monotonic()
    _, names = _copy(rank, world, root, 4e7, keep_part=rank == 1, group_timeout=COPIES_TIMEOUT)
    return time.monotonic() - start, names


# The copies' group time-out where a test tells copies that end at once from copies that wait it out: far above what
# starting the copies' processes and group takes on a loaded 2-core machine (up to about 35 s seen)
COPIES_TIMEOUT = 180


def test_a_copy_that_fails_on_one_host_leaves_the_step_unreplicated_on_every_host(tmp_path):
    """Host 2 finds host 1's part damaged on arrival: no host marks the step REPLICATED, every rank's copies end at
    once, not at the copies' group time-out."""
    results = run_ranks(_copy_a_part_damaged_on_host_1, 3, str(tmp_path))
    for rank, (status, value) in enumerate(results):
        assert status == "ok", value
        seconds, names = value
        assert seconds < COPIES_TIMEOUT / 2, (rank, seconds)
        assert "REPLICATED" not in names and "COPYING" in names
        assert not [n for n in names if n.startswith(".")]
    assert "rank-1.pt" not in results[2][1][1]  # host 2 kept nothing of rank 1's damaged part


def _copy_with_host_1s_part_gone(rank: int, world: int, root: str):
    """Each host's part of step 4 exchanged (`copy_step`), host 1's part gone from its disk (its checksum line too)."""
    import time

    from aqpipe.runtime.checkpoints import copies

    out = Path(root) / f"host-{rank}"
    ck.save_rank(out, 4, rank, {"model": {"w": torch.randn(100_000)}}, SETTINGS)
    if rank == 1:
        for path in ck.step_dir(out, 4).glob("rank-1.*"):
            path.unlink()
    start = time.monotonic()
    try:
        copies.copy_step(out, 4, rank, copies.copy_plan([f"host-{r}" for r in range(world)], 1), None, 4e6)
        problem = ""
    except (RuntimeError, OSError) as e:
        problem = f"{type(e).__name__}: {e}"
    return time.monotonic() - start, problem


def test_a_part_its_rank_cannot_read_ends_the_exchange_on_every_rank_at_once(tmp_path):
    """The rank takes part in the copies' collectives with nothing to send and fails, its holder keeps nothing of
    it and fails, and the third host keeps the copy it received (a rank that raised before the first collective would
    leave the others' collectives to meet its next one: a hang or garbage)."""
    results = run_ranks(_copy_with_host_1s_part_gone, 3, str(tmp_path))
    assert all(status == "ok" for status, _ in results), results
    seconds, problems = zip(*(value for _, value in results))
    assert problems[0] == "" and "reading its part" in problems[1]
    assert "rank 1 could not read its part" in problems[2]
    assert max(seconds) < 20, seconds
    assert not ck.rank_file(ck.step_dir(tmp_path / "host-2", 4), 1).exists()
    ck.check_rank(tmp_path / "host-0", 4, 2, SETTINGS)  # (host 2's part, kept on host 0)


def _copy_twice_host_1_unable_to_listen_at_first(rank: int, world: int, root: str):
    """Two checkpoints' copies in a row (each followed by the verdicts' gather, as the copies' process does); at the
    first, host 1 cannot open the listening socket its copy should arrive on."""
    import torch.distributed as dist

    from aqpipe.pipeline.links import streams
    from aqpipe.runtime.checkpoints import copies

    out = Path(root) / f"host-{rank}"
    plan = copies.copy_plan([f"host-{r}" for r in range(world)], 1)
    outcomes = []
    for step in (4, 8):
        ck.save_rank(out, step, rank, {"model": {"w": torch.randn(1000)}}, SETTINGS)
        listener = streams.Listener
        if rank == 1 and step == 4:
            def refused(address):
                raise OSError(24, "Too many open files")

            streams.Listener = refused
        try:
            copies.copy_step(out, step, rank, plan, None, 4e6, timeout=10)
            outcomes.append("")
        except Exception as e:  # noqa: BLE001 - the outcome is the test's
            outcomes.append(f"{type(e).__name__}: {e}")
        finally:
            streams.Listener = listener
        verdicts: list = [None] * world
        dist.all_gather_object(verdicts, outcomes[-1])
    return outcomes, sorted(p.name for p in ck.step_dir(out, 8).iterdir())


def test_a_host_that_cannot_listen_for_its_copy_fails_the_copy_on_every_rank_and_the_next_one_goes_through(tmp_path):
    """Host 1 takes part in the gather of the streams' endpoints with nothing to offer, so every collective after it
    (the verdicts, the next checkpoint's copies) meets its own (one that raised before the gather would leave every
    later collective off by one)."""
    results = run_ranks(_copy_twice_host_1_unable_to_listen_at_first, 3, str(tmp_path))
    assert all(status == "ok" for status, _ in results), results
    for rank, (_, (outcomes, names)) in enumerate(results):
        assert "rank 1 cannot listen" in outcomes[0] and "Too many open files" in outcomes[0], (rank, outcomes)
        assert outcomes[1] == "", (rank, outcomes)
        assert f"rank-{(rank - 1) % 3}.pt" in names  # (the second checkpoint's copy, kept)


def _paces_of_two_copies(rank: int, world: int, root: str):
    """Each host's part of step 4 sent to the two other hosts (`--checkpoint-replicas 2`): the pace the kernel was
    asked for on each of this rank's streams."""
    from aqpipe.runtime.checkpoints import copies

    out = Path(root) / f"host-{rank}"
    ck.save_rank(out, 4, rank, {"model": {"w": torch.randn(10_000)}}, SETTINGS)
    asked = []
    kernel = copies.pace
    copies.pace = lambda stream, rate: asked.append(rate) or kernel(stream, rate)
    copies.copy_step(out, 4, rank, copies.copy_plan([f"host-{r}" for r in range(world)], 2), None, 4e5)
    return asked, sorted(p.name for p in ck.step_dir(out, 4).glob("rank-*.pt"))


def test_a_rank_with_two_copies_splits_its_pace_between_their_streams(tmp_path):
    for rank, (status, value) in enumerate(run_ranks(_paces_of_two_copies, 3, str(tmp_path))):
        assert status == "ok", value
        assert value == ([2e5, 2e5], ["rank-0.pt", "rank-1.pt", "rank-2.pt"]), rank
