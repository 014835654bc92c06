"""--grad-sync specs: every method parses, every bad value gets a message naming the fix."""

import re

import pytest
import torch

from aqpipe.compress.grad import GradSpecError, build_grad_sync, check_pairing, parse_grad_spec
from aqpipe.compress.grad.base import PATTERNS, Compressor, DPGroup
from aqpipe.compress.grad.methods import METHODS
from aqpipe.compress.grad.wire import ring_all_reduce_bytes

EXAMPLES = ["none", "fp16", "bf16", "powersgd:2", "ef:4", "topk:0.01", "signsgd", "marsit:0", "marsit:100", "fft:0.9:10", "fft:0:32", "sidco:exp:0.01", "sidco:gamma:0.001", "sidco:gpareto:0.1", "qadam:4"]


@pytest.mark.parametrize("text", EXAMPLES)
def test_every_method_builds_and_declares_its_pattern(text):
    sync = build_grad_sync(text, DPGroup(None, (0,), 0))
    assert sync.pattern in PATTERNS
    assert sync.bytes_sent == 0 and isinstance(sync.state_dict(), dict)
    assert parse_grad_spec(text).method in METHODS


@pytest.mark.parametrize("text, message", [
    ("gzip", "not a gradient compressor"), ("powersgd", "write it as powersgd:R"), ("powersgd:0", "at least 1"),
    ("ef:9", "1..8 bits"), ("qadam:0", "1..8 bits"), ("ef:x", "must be a number"), ("topk:0", "(0, 1]"), ("topk:2", "(0, 1]"),
    ("marsit:-1", "K must be 0"), ("fft:1:8", "[0, 1)"), ("fft:0.5:20", "N must be 2..16"), ("fft:0.5", "THETA:N"),
    ("sidco:normal:0.1", "exp, gamma or gpareto"), ("sidco:exp:1", "(0, 1)"), ("sidco:exp", "DIST:F"), ("signsgd:3", "write it as signsgd"), ("none:1", "write it as none"),
])
def test_bad_specs_say_what_to_write(text, message):
    with pytest.raises(GradSpecError, match=re.escape(message)):
        parse_grad_spec(text)


def test_qadam_needs_adamw():
    check_pairing(parse_grad_spec("qadam:2"), "adamw")
    with pytest.raises(GradSpecError, match="use --optimizer adamw"):
        check_pairing(parse_grad_spec("qadam:2"), "sgd")


@pytest.mark.parametrize("text", ["signsgd", "marsit:10"])
def test_sign_methods_need_sgd(text):
    check_pairing(parse_grad_spec(text), "sgd")
    with pytest.raises(GradSpecError, match="use --optimizer sgd"):
        check_pairing(parse_grad_spec(text), "adamw")


@pytest.mark.parametrize("method", sorted(METHODS))
def test_each_rows_capabilities_are_what_its_class_does(method):
    """A row says what its class is (the configuration reads the row, before torch loads): sign-based, clippable,
    and whether the optimizer it needs is its own."""
    from aqpipe.compress.grad.registry import method_class

    kind, implementation = METHODS[method], method_class(method)
    assert issubclass(implementation, Compressor)
    assert (implementation.sign_based, implementation.clippable) == (kind.sign_based, kind.clippable)
    assert (implementation.own_optimizer is not Compressor.own_optimizer) == kind.own_optimizer
    assert kind.optimizer in ("", "sgd", "adamw")


# A method of this test's own, added the way a new one is added: one row and its class, nothing else anywhere
class ClampedMean(Compressor):
    """Each gradient clamped to ±C, then the fp32 mean."""

    pattern = "all-reduce"
    peak_copies = 2.0

    def __init__(self, dp: DPGroup, bound: float) -> None:
        super().__init__(dp)
        self.bound, self.name = bound, f"clampmean:{bound:g}"

    def combine(self, flat: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        flat = flat.clamp(-self.bound, self.bound)
        dist.all_reduce(flat, group=self.dp.group)
        self.bytes_sent += ring_all_reduce_bytes(4 * flat.numel(), self.dp.size)
        return flat.div_(self.dp.size)


def _fixture_row():
    from aqpipe.compress.grad.methods import MethodKind, Param

    return MethodKind((Param("C", float, lambda bound: bound > 0, "the bound C must be positive"),),
                      "each gradient clamped to ±C, then the fp32 mean", f"{__name__}:ClampedMean")


def _two_replicas_run_the_new_method(rank: int, world: int) -> list[float]:
    METHODS["clampmean"] = _fixture_row()
    sync = build_grad_sync("clampmean:0.5", DPGroup(None, tuple(range(world)), rank))
    param = torch.nn.Parameter(torch.zeros(3))
    param.grad = torch.tensor([1.0, -0.2, 0.1]) * (rank + 1)  # rank 1: [2, -0.4, 0.2]
    sync.synchronize([param])
    return [*param.grad.tolist(), sync.bytes_sent]


def test_a_new_method_is_one_row_and_its_class(monkeypatch, tmp_path):
    """Added as a user adds one (a row naming its class), a method parses with its argument checked, is in the help,
    passes the configuration, is sized by the capacity plan from its class, and runs on two replicas."""
    import dataclasses

    from aqpipe.compress.grad.methods import describe_methods_help
    from aqpipe.compress.grad.registry import sync_copies, sync_step_bytes
    from aqpipe.compress.grad.wire import SyncBytes
    from aqpipe.runtime.capacity import plan as cap
    from aqpipe.runtime.plan import make_plan
    from tests.distributed import run_ranks
    from tests.test_capacity import SMALL, flags_to_config

    monkeypatch.setitem(METHODS, "clampmean", _fixture_row())
    assert parse_grad_spec("clampmean:0.5").args == (0.5,)
    with pytest.raises(GradSpecError, match="the bound C must be positive"):
        parse_grad_spec("clampmean:0")
    with pytest.raises(GradSpecError, match="write it as clampmean:C"):
        parse_grad_spec("clampmean")
    assert "clampmean:C (each gradient clamped" in describe_methods_help()
    check_pairing(parse_grad_spec("clampmean:1"), "sgd")

    shapes = [(10, 4), (4,)]
    assert sync_step_bytes("clampmean:0.5", 2, shapes) == SyncBytes.every_step(ring_all_reduce_bytes(4 * 44, 2))
    assert sync_copies("clampmean:0.5", 2) == (0.0, 2.0) and sync_copies("clampmean:0.5", 1) == (0.0, 0.0)
    monkeypatch.setattr(cap, "check_fits", lambda capacity: None)
    cfg = flags_to_config([*SMALL, "--dp", "2", "--grad-sync", "clampmean:0.5"], tmp_path)
    plan = cap.plan_capacity(make_plan(dataclasses.replace(cfg)))
    assert all(s.sync_peak_bytes == int(4 * 2.0 * s.trainable) for s in plan.stages if s.trainable)

    results = run_ranks(_two_replicas_run_the_new_method, 2)
    assert all(status == "ok" for status, _ in results), results
    for _, (*grad, sent) in results:
        assert grad == pytest.approx([0.5, -0.3, 0.15]) and sent == ring_all_reduce_bytes(12, 2)


def test_a_row_that_misdescribes_its_class_is_refused_when_the_class_loads(monkeypatch):
    """The configuration reads a row's capabilities before torch loads, the run its class's: they cannot disagree."""
    from aqpipe.compress.grad.methods import MethodKind
    from aqpipe.compress.grad.registry import build_grad_sync

    monkeypatch.setitem(METHODS, "clampmean", MethodKind(
        _fixture_row().params, "claims to be a sign method", f"{__name__}:ClampedMean", sign_based=True))
    with pytest.raises(TypeError, match="its row says .* its class"):
        build_grad_sync("clampmean:1", DPGroup(None, (0,), 0))


def test_a_rows_optimizer_and_reason_refuse_the_others(monkeypatch):
    from aqpipe.compress.grad.methods import MethodKind

    monkeypatch.setitem(METHODS, "clampmean", MethodKind(
        _fixture_row().params, "clamped", f"{__name__}:ClampedMean", optimizer="sgd",
        needs_optimizer_because="clamps what SGD steps by; --optimizer {given} rescales it"))
    check_pairing(parse_grad_spec("clampmean:1"), "sgd")
    with pytest.raises(GradSpecError, match=r"clampmean clamps what SGD steps by; --optimizer adamw rescales it — use "
                                            r"--optimizer sgd"):
        check_pairing(parse_grad_spec("clampmean:1"), "adamw")

