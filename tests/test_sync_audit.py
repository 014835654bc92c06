"""The CUDA sync audit's bookkeeping (aqpipe.pipeline.sync_audit), with CUDA's sync debug mode stood in for: which
steps it audits, how it counts and places the warnings, and that other warnings still reach the user."""

import threading
import warnings

import torch

from aqpipe.pipeline import sync_audit
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
