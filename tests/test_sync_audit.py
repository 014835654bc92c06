"""The CUDA sync audit's bookkeeping (aqpipe.pipeline.execution.sync_audit), with CUDA's sync debug mode stood in for: which
steps it audits, how it counts and places the warnings, and that other warnings still reach the user."""

import threading
import warnings
from types import SimpleNamespace

import torch

from aqpipe.compress.link.aqsgd_rows import Candidates, verdicts_of
from aqpipe.pipeline.execution import sync_audit
from aqpipe.storage.base import on_device


def _pretend_cuda(monkeypatch):
    modes = []
    monkeypatch.setattr(sync_audit, "enabled", lambda device: True)
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)
    return modes


def test_a_step_counts_its_synchronizing_calls_by_place(monkeypatch, capsys, recwarn):
    modes = _pretend_cuda(monkeypatch)
    real_to = torch.Tensor.to

    def warning_to(self, *args, **kwargs):  # what CUDA's debug mode says of a copy that makes the host wait
        if threading.current_thread() is threading.main_thread():  # (another test's lingering thread is not ours)
            warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=2)
        return real_to(self, *args, **kwargs)

    with sync_audit.audited(5, torch.device("cuda")):
        monkeypatch.setattr(torch.Tensor, "to", warning_to)
        on_device([torch.ones(2), torch.ones(2)], "meta")  # one stacked copy: one wait
        warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=1)  # from outside aqpipe
        warnings.warn("something else entirely", UserWarning, stacklevel=1)
    monkeypatch.setattr(torch.Tensor, "to", real_to)
    err = capsys.readouterr().err
    assert "cuda sync audit: step 5: 2 synchronizing calls" in err
    assert "aqpipe/storage/base.py:" in err and " on_device" in err and "(outside aqpipe)" in err
    assert "something else entirely" in [str(w.message) for w in recwarn]  # passed on as it would have been
    assert modes == ["warn", 0]  # on for the step, then back as it was


def test_a_helper_that_warns_for_its_caller_is_placed_at_its_caller(monkeypatch, capsys):
    """An AQ-SGD sender's wait for its verdicts' copy warns from a helper with stacklevel=2, as torch would have of the
    read it replaced: the audit places it in `read_all`, which the GPU test's expected places name (on an H200 it was
    placed in the helper, and that test failed)."""
    _pretend_cuda(monkeypatch)
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: 1)  # "warn", as during an audited step
    waits = []
    arrived = SimpleNamespace(device=torch.device("cuda"), synchronize=lambda: waits.append(1))
    group = Candidates([0], torch.zeros(1, 1), verdicts_of(torch.tensor([True]), torch.tensor([3])))
    group.arrival = arrived
    with sync_audit.audited(5, torch.device("cuda")):
        Candidates.read_all([group])
    err = capsys.readouterr().err
    assert waits == [1] and (group.fits, group.sums) == ([True], [3])
    assert "cuda sync audit: step 5: 1 synchronizing calls" in err
    places = [line.split()[-1] for line in err.splitlines() if "aqsgd_rows.py:" in line]
    assert places == ["read_all"], err


def test_the_first_steps_and_a_host_device_are_not_audited(monkeypatch, capsys):
    modes = _pretend_cuda(monkeypatch)
    with sync_audit.audited(sync_audit.FIRST_AUDITED_STEP - 1, torch.device("cuda")):
        pass
    assert modes == [] and capsys.readouterr().err == ""
    monkeypatch.undo()
    monkeypatch.setenv(sync_audit.ENV, "1")
    assert sync_audit.enabled(torch.device("cuda")) and not sync_audit.enabled(torch.device("cpu"))
    monkeypatch.setenv(sync_audit.ENV, "0")
    assert not sync_audit.enabled(torch.device("cuda"))
