"""NVIDIA MPS detection and the note a launch gives when ranks share a GPU (no GPU needed)."""

import os

from aqpipe.launch.gpu_sharing import mps_running, ranks_per_gpu, sharing_note


def test_mps_is_found_by_its_control_pipe(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path))
    assert not mps_running()
    (tmp_path / "control").write_text("")  # a plain file is no daemon's pipe
    assert not mps_running()
    (tmp_path / "control").unlink()
    os.mkfifo(tmp_path / "control")
    assert mps_running()


def test_ranks_per_gpu_follows_rank_mod_gpus():
    assert ranks_per_gpu(4, 1) == 4
    assert ranks_per_gpu(4, 4) == 1
    assert ranks_per_gpu(5, 2) == 3
    assert ranks_per_gpu(4, 0) == 0


def test_the_note_says_time_slicing_and_how_to_start_mps_only_when_ranks_share_a_gpu():
    note = sharing_note("cuda", 4, 1, mps=False)
    assert note is not None and "4 ranks share each GPU" in note and "nvidia-cuda-mps-control -d" in note
    assert "time-slicing" in note
    assert "through NVIDIA MPS" in sharing_note("cuda", 4, 1, mps=True)
    assert sharing_note("cuda", 4, 4, mps=False) is None  # a GPU per rank
    assert sharing_note("cpu", 4, 0, mps=False) is None


def test_this_machines_ranks_are_its_local_world_under_torchrun(monkeypatch):
    import torch

    from aqpipe.launch.gpu_sharing import local_sharing_note

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", "/nonexistent")
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert "4 ranks share each GPU" in local_sharing_note("cuda", 8)  # a local launch: all 8 ranks, 2 GPUs
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert local_sharing_note("cuda", 8) is None  # torchrun: 2 ranks here, a GPU each
    assert local_sharing_note("cpu", 8) is None
