"""Checkpoint files: atomic, checksummed, complete-or-ignored, and every damage named."""

import pytest
import torch

from aqpipe.runtime.checkpoints import parts as ck


def _state(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"model": {"0.weight": torch.randn(4, 3, generator=g)}, "rng": {"torch": torch.get_rng_state()}}


SETTINGS = {"model": "gpt2-tiny", "seq_len": 16, "fw": "aqsgd:4"}


def _save(tmp_path, step, world=2, settings=SETTINGS):
    for rank in range(world):
        ck.save_rank(tmp_path, step, rank, _state(rank), settings)
    ck.mark_complete(tmp_path, step, world, settings)


def test_round_trip_with_weights_only_loading(tmp_path):
    _save(tmp_path, 5)
    state = ck.load_rank(tmp_path, 5, 1)
    assert torch.equal(state["model"]["0.weight"], _state(1)["model"]["0.weight"])
    assert state["step"] == 5 and state["rank"] == 1
    ck.verify(tmp_path, 5, 2, SETTINGS)


def test_latest_is_the_newest_complete_checkpoint_and_old_ones_are_pruned(tmp_path):
    for step in (2, 4, 6):
        _save(tmp_path, step)
    ck.save_rank(tmp_path, 8, 0, _state(), SETTINGS)  # a run killed while saving step 8: no COMPLETE marker
    assert ck.latest_step(tmp_path) == 6
    kept = sorted(p.name for p in ck.root(tmp_path).glob("step-*"))
    assert kept == ["step-00000004", "step-00000006", "step-00000008"]
    assert ck.latest_step(tmp_path / "elsewhere") is None


def test_the_newest_checkpoint_whose_copies_all_arrived_is_kept_until_a_newer_ones_have(tmp_path):
    """Steps 8 and 12 written, their copies to other hosts never finished (no REPLICATED): pruning to the two newest
    deleted step 4, the one a host that loses its disk could still come back from."""
    _save(tmp_path, 4)
    (ck.step_dir(tmp_path, 4) / "REPLICATED").write_bytes(b"")
    for step in (8, 12):
        _save(tmp_path, step)
    assert sorted(p.name for p in ck.root(tmp_path).glob("step-*")) == ["step-00000004", "step-00000008",
                                                                       "step-00000012"]
    (ck.step_dir(tmp_path, 12) / "REPLICATED").write_bytes(b"")
    _save(tmp_path, 16)
    assert sorted(p.name for p in ck.root(tmp_path).glob("step-*")) == ["step-00000012", "step-00000016"]


def test_latest_is_the_newest_step_marked_complete_even_where_the_pointer_lags(tmp_path):
    """A run stopped between marking step 6 complete and pointing `latest` at it: step 6 is the newest."""
    for step in (2, 4, 6):
        _save(tmp_path, step)
    (ck.root(tmp_path) / "latest").write_text("step-00000004\n")
    assert ck.latest_step(tmp_path) == 6


@pytest.mark.parametrize("damage,message", [
    (lambda f: f.write_bytes(f.read_bytes()[:-100]), "damaged or truncated"),
    (lambda f: f.write_bytes(f.read_bytes()[:50] + b"X" + f.read_bytes()[51:]), "damaged or truncated"),
    (lambda f: f.unlink(), "is missing"),
    (lambda f: f.with_suffix(".sha256").unlink(), "has no checksum file"),
])
def test_damage_is_an_error_naming_the_file(tmp_path, damage, message):
    _save(tmp_path, 3)
    victim = ck.rank_file(ck.step_dir(tmp_path, 3), 1)
    damage(victim)
    with pytest.raises(ck.CheckpointError, match=message) as err:
        ck.verify(tmp_path, 3, 2, SETTINGS)
    assert str(victim) in str(err.value)
    with pytest.raises(ck.CheckpointError, match=message):
        ck.load_rank(tmp_path, 3, 1)
    ck.load_rank(tmp_path, 3, 0)  # the sound file still loads


def test_a_checkpoint_of_another_world_size_or_not_complete_is_refused(tmp_path):
    _save(tmp_path, 3)
    with pytest.raises(ck.CheckpointError, match="written by 2 ranks, this run has 4"):
        ck.verify(tmp_path, 3, 4, SETTINGS)
    ck.save_rank(tmp_path, 9, 0, _state(), SETTINGS)
    with pytest.raises(ck.CheckpointError, match="incomplete"):
        ck.verify(tmp_path, 9, 1, SETTINGS)


def test_a_file_that_is_not_an_aqpipe_checkpoint_is_refused(tmp_path):
    import hashlib
    import io

    _save(tmp_path, 3)
    path = ck.rank_file(ck.step_dir(tmp_path, 3), 0)
    buf = io.BytesIO()
    torch.save({"something": 1}, buf)
    path.write_bytes(buf.getvalue())
    path.with_suffix(".sha256").write_text(hashlib.sha256(buf.getvalue()).hexdigest() + " rank=0 step=3")
    with pytest.raises(ck.CheckpointError, match="not an aqpipe checkpoint"):
        ck.load_rank(tmp_path, 3, 0)


def test_a_model_state_that_does_not_fit_the_stage_is_refused_before_loading():
    module = torch.nn.Sequential(torch.nn.Linear(3, 4))
    before = module[0].weight.detach().clone()
    with pytest.raises(ck.CheckpointError, match="has shape"):
        ck.check_model_state("x", module, {"0.weight": torch.zeros(5, 3), "0.bias": torch.zeros(4)})
    with pytest.raises(ck.CheckpointError, match="missing"):
        ck.check_model_state("x", module, {"0.weight": torch.zeros(4, 3)})
    assert torch.equal(module[0].weight, before)


def test_a_changed_setting_is_named_before_anything_loads(tmp_path):
    _save(tmp_path, 3)
    with pytest.raises(ck.CheckpointError, match="written with seq_len = 16, but the run's configuration now says 32"):
        ck.verify(tmp_path, 3, 2, {**SETTINGS, "seq_len": 32})
    with pytest.raises(ck.CheckpointError, match="written with fw = 'aqsgd:4', but .* now says 'fp32'"):
        ck.verify(tmp_path, 3, 2, {**SETTINGS, "fw": "fp32"})
    with pytest.raises(ck.CheckpointError, match="other settings"):
        ck.load_rank(tmp_path, 3, 0, {**SETTINGS, "fw": "fp32"})
    ck.load_rank(tmp_path, 3, 0, SETTINGS)


def test_an_edited_settings_record_is_refused(tmp_path):
    _save(tmp_path, 3)
    record = ck.step_dir(tmp_path, 3) / "run.json"
    record.write_text(record.read_text().replace('"seq_len": 16', '"seq_len": 32'))
    with pytest.raises(ck.CheckpointError, match="damaged or was edited"):
        ck.verify(tmp_path, 3, 2, {**SETTINGS, "seq_len": 32})


def test_a_rank_file_copied_over_another_is_caught_with_its_checksum(tmp_path):
    import shutil

    _save(tmp_path, 3)
    directory = ck.step_dir(tmp_path, 3)
    for suffix in (".pt", ".sha256"):
        shutil.copy(directory / f"rank-0{suffix}", directory / f"rank-1{suffix}")
    with pytest.raises(ck.CheckpointError, match=r"rank-1.pt was written for rank 0 step 3, not rank 1 step 3"):
        ck.verify(tmp_path, 3, 2, SETTINGS)


def test_incomplete_checkpoints_are_removed_once_a_newer_one_is_complete(tmp_path):
    _save(tmp_path, 2)
    ck.save_rank(tmp_path, 4, 0, _state(), SETTINGS)  # killed while saving step 4
    ck.save_rank(tmp_path, 9, 1, _state(), SETTINGS)  # an earlier attempt that got further, then was resumed
    _save(tmp_path, 6)
    assert sorted(p.name for p in ck.root(tmp_path).glob("step-*")) == ["step-00000002", "step-00000006"]


def test_a_rank_state_is_neither_saved_nor_loaded_whole_in_memory_a_second_time(tmp_path):
    """An in-memory m(xi) store may be most of a host's memory, and the run's last checkpoint comes before its final
    weights: serializing the state into memory (then reading the file back whole on resume) held it twice."""
    import tracemalloc

    from aqpipe.runtime.checkpoints.parts import load_rank, save_rank

    store = {i: torch.full((64 * 1024,), float(i)) for i in range(128)}  # 32 MiB in 256 KiB samples
    size = sum(t.numel() * t.element_size() for t in store.values())
    tracemalloc.start()
    try:
        save_rank(tmp_path, 3, 1, {"store": store}, {"lr": 1.0})
        saving = tracemalloc.get_traced_memory()[1]
        tracemalloc.reset_peak()
        state = load_rank(tmp_path, 3, 1, {"lr": 1.0})
        loading = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert all(torch.equal(state["store"][i], store[i]) for i in store)
    assert saving < size / 8 and loading < size / 8, (saving, loading, size)


def test_writing_a_rank_state_reports_its_bytes_as_they_reach_the_disk(tmp_path, monkeypatch):
    """A large state on a slow disk takes minutes to write, longer than --stall-timeout: the launcher must hear of
    each piece (it counts only progress events), and each piece must be on the disk when it is reported, not in
    the page cache with the whole state's fsync still to come."""
    import os

    synced = []  # the file's size at each fdatasync (made on the writer's syncing thread)
    monkeypatch.setattr(ck, "SYNC_EVERY_BYTES", 1 << 20)
    monkeypatch.setattr(ck.os, "fdatasync", lambda fd: synced.append(os.fstat(fd).st_size))
    reports = []  # (done, total, the most bytes on the disk when it was reported)
    store = {i: torch.full((64 * 1024,), float(i)) for i in range(32)}  # 8 MiB in 256 KiB samples
    path = ck.save_rank(tmp_path, 3, 1, {"store": store}, {"lr": 1.0},
                        lambda done, total: reports.append((done, total, max(synced, default=0))))
    size = path.stat().st_size
    assert len(reports) >= 8 and reports[-1][:2] == (size, size), reports[-3:]
    assert all(a[0] < b[0] for a, b in zip(reports, reports[1:])) and all(done < total for done, total, _ in reports[:-1])
    assert all(done <= on_disk for done, _, on_disk in reports[:-1]), reports
    assert 7 <= len(synced) <= 9, synced
    assert ck.load_rank(tmp_path, 3, 1, {"lr": 1.0})["store"][5].eq(5.0).all()


def test_a_full_disk_met_by_a_piece_syncing_in_the_background_fails_the_save(tmp_path, monkeypatch):
    """Some filesystems report a full disk only when the data is flushed: the piece's sync runs on another thread,
    and its error must still fail the save, leaving no file behind."""
    import errno

    from aqpipe.disk import DiskFullError

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ck, "SYNC_EVERY_BYTES", 1 << 20)
    monkeypatch.setattr(ck.os, "fdatasync", full)
    with pytest.raises(DiskFullError):
        ck.save_rank(tmp_path, 3, 1, {"store": {i: torch.zeros(64 * 1024) for i in range(32)}}, {"lr": 1.0})
    assert list(ck.step_dir(tmp_path, 3).iterdir()) == []


def test_one_tensor_larger_than_a_piece_is_written_and_reported_piece_by_piece(tmp_path, monkeypatch):
    """torch.save hands a tensor's whole storage to one write: a flat error-feedback residual or an embedding's Adam
    moments of many pieces went to the disk with no report until the end. A view sharing a storage counts once."""
    synced = []
    monkeypatch.setattr(ck, "SYNC_EVERY_BYTES", 1 << 20)
    monkeypatch.setattr(ck.os, "fdatasync", lambda fd: synced.append(fd))
    residual = torch.arange(2 * 1024 * 1024, dtype=torch.float32)  # 8 MiB in one storage
    reports = []
    state = {"grad_sync": {"residual": residual, "head": residual[:10]}}
    path = ck.save_rank(tmp_path, 3, 1, state, {"lr": 1.0}, lambda done, total: reports.append((done, total)))
    assert len(synced) >= 8 and len(reports) >= 8, (synced, reports)
    assert {total for _, total in reports[:-1]} == {8 << 20} and reports[-1] == (path.stat().st_size,) * 2
    assert torch.equal(ck.load_rank(tmp_path, 3, 1, {"lr": 1.0})["grad_sync"]["residual"], residual)


def test_the_launcher_checks_the_ranks_files_side_by_side(tmp_path, monkeypatch):
    """Before a resume the launcher hashes every rank's file of the checkpoint (gigabytes each with an in-memory m(ξ)
    store): one after the other, that was the sum of their times on one core. Each file is hashed on a thread of its
    own (hashing and reading let the others run); a damaged one is named, the lowest rank's first."""
    import threading

    _save(tmp_path, 3, world=4)
    both_at_once = threading.Barrier(4, timeout=10)
    original = ck._sha256_of

    def meeting(file):
        both_at_once.wait()  # (one after the other, the first waits here alone until the time-out)
        return original(file)

    monkeypatch.setattr(ck, "_sha256_of", meeting)
    ck.verify(tmp_path, 3, 4, SETTINGS)
    for rank in (3, 1):
        victim = ck.rank_file(ck.step_dir(tmp_path, 3), rank)
        victim.write_bytes(victim.read_bytes()[:-10])
    both_at_once.reset()
    with pytest.raises(ck.CheckpointError, match="rank-1.pt is damaged"):
        ck.verify(tmp_path, 3, 4, SETTINGS)


@pytest.mark.parametrize("damage", ["checksum not text", "file unreadable"])
def test_a_checksum_line_that_is_not_text_or_a_file_that_cannot_be_read_is_a_checkpoint_error(tmp_path, monkeypatch, damage):
    """Every way a rank's file can be bad is a CheckpointError naming it: a UnicodeDecodeError or OSError escaped
    instead (a traceback in the launcher, and under torchrun one rank leaving the others to agree without it)."""
    _save(tmp_path, 3)
    victim = ck.rank_file(ck.step_dir(tmp_path, 3), 1)
    if damage == "checksum not text":
        victim.with_suffix(".sha256").write_bytes(b"\xff\xfe\x00garbage")
    else:
        original = ck._sha256_of

        def unreadable(file):
            if file.name == str(victim):
                raise OSError(5, "Input/output error")
            return original(file)

        monkeypatch.setattr(ck, "_sha256_of", unreadable)
    with pytest.raises(ck.CheckpointError, match="rank-1") as err:
        ck.verify(tmp_path, 3, 2, SETTINGS)
    assert str(victim) in str(err.value)
    with pytest.raises(ck.CheckpointError):
        ck.check_rank(tmp_path, 3, 1, SETTINGS)


def test_checkpoints_set_aside_keep_their_files_out_of_every_resume_and_replace_an_earlier_one(tmp_path):
    for step in (2, 4):
        _save(tmp_path, step)
    aside = ck.root(tmp_path) / "unsound-step-00000004"
    aside.mkdir()
    (aside / "from-before").write_text("x")  # set aside by an earlier resume
    assert ck.set_aside_steps_after(tmp_path, 2) == [aside]
    assert sorted(p.name for p in aside.iterdir()) == sorted(p.name for p in ck.step_dir(tmp_path, 2).iterdir())
    assert ck.complete_steps(tmp_path) == [2] and ck.latest_step(tmp_path) == 2
    assert (ck.root(tmp_path) / "latest").read_text().strip() == "step-00000002"
    _save(tmp_path, 4)  # the steps trained again: their checkpoint is written anew, the one set aside stays
    assert ck.latest_step(tmp_path) == 4 and aside.is_dir()
