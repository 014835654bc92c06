"""The gradient compressors, by name: the one table `--grad-sync`, the configuration's checks, the CLI help and
`aqpipe.compress.grad.registry` read, with the parser of a `--grad-sync` value (no torch import, so the
configuration and the help can use it cheaply).

A method is one row here and its class (`implementation`), which builds it from its parsed arguments
(`from_spec`) and says what it sends per step (`step_bytes`) and what memory it holds (`memory_copies`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


class GradSpecError(ValueError):
    """A --grad-sync value that names no method or gives it bad arguments; the text says what is allowed."""


@dataclass(frozen=True)
class Param:
    """One argument of a method: its name in the usage (`powersgd:R`), how its text reads (a ValueError: not a
    number), the values it allows, and what an error says when it is outside them."""

    name: str
    read: Callable[[str], Any]
    allowed: Callable[[Any], bool]
    rule: str


@dataclass(frozen=True)
class MethodKind:
    """One --grad-sync method: its arguments, its help, the class that implements it (`module:Class`, imported only
    when a sync is built or sized), and what it is: sign-based (the update is lr·sign, so it runs without replicas
    too, and clipping its norm would only shrink it where `clippable` is false), the only `--optimizer` it runs under
    and why, whether that optimizer is its own (it exchanges state through the sync), whether it compresses (sends
    well under the fp32 average's bytes), and whether every replica computes its result with GPU arithmetic that
    agrees bit for bit only on one GPU model, CUDA and torch (`replica_computed`). `registry.method_class` holds the
    class to the row."""

    params: tuple[Param, ...]
    summary: str
    implementation: str
    sign_based: bool = False
    clippable: bool = True
    optimizer: str = ""  # the --optimizer it needs ("": any)
    needs_optimizer_because: str = ""  # why, with {given} for the --optimizer refused
    own_optimizer: bool = False  # its class builds that optimizer (`GradSync.own_optimizer`)
    compresses: bool = True
    replica_computed: bool = False


BITS = Param("B", int, lambda bits: 1 <= bits <= 8, "B must be 1..8 bits")
SIGN_NEEDS_SGD = "makes the update lr*sign, an optimizer in itself; --optimizer {given} would rescale the signs"
_GRAD = "aqpipe.compress.grad"
METHODS: dict[str, MethodKind] = {
    "none": MethodKind((), "fp32 all-reduce average", f"{_GRAD}.base:AllReduceMean", compresses=False),
    "fp16": MethodKind((), "average all-reduced in fp16", f"{_GRAD}.cast:CastAllReduce", compresses=False),
    "bf16": MethodKind((), "average all-reduced in bf16", f"{_GRAD}.cast:CastAllReduce", compresses=False),
    # (PowerSGD orthogonalizes its factor on every replica: QR and P·Qᵀ)
    "powersgd": MethodKind(
        (Param("R", int, lambda rank: rank >= 1, "the rank R must be at least 1"),),
        "rank-R PowerSGD with error feedback (torch's own hook)", f"{_GRAD}.powersgd:PowerSGD", replica_computed=True),
    "ef": MethodKind((BITS,), "B-bit quantized gradients with error feedback, all-gathered",
                     f"{_GRAD}.quantized:ErrorFeedbackQuantized"),
    "qadam": MethodKind(
        (BITS,), "QuantizedAdam: AdamW warm-up on fp32 averages, then frozen v and the momentum exchanged B-bit with "
        "worker and server error feedback (use AdamW)", f"{_GRAD}.qadam:QAdamSync", optimizer="adamw",
        needs_optimizer_because="is a compressed Adam; --optimizer {given} cannot run it", own_optimizer=True),
    "topk": MethodKind(
        (Param("F", float, lambda fraction: 0 < fraction <= 1, "the kept fraction F must be in (0, 1]"),),
        "largest fraction F of the gradient with error feedback, values and indices all-gathered",
        f"{_GRAD}.topk:TopK"),
    "sidco": MethodKind(
        (Param("DIST", str, lambda name: name in ("exp", "gamma", "gpareto"), "DIST must be exp, gamma or gpareto"),
         Param("F", float, lambda fraction: 0 < fraction < 1, "the target fraction F must be in (0, 1)")),
        "SIDCo: keep about the fraction F above a threshold read off a fitted distribution DIST = exp, gamma or "
        "gpareto (multi-stage, adaptive), error feedback", f"{_GRAD}.sidco:SIDCo"),
    "fft": MethodKind(
        (Param("THETA", float, lambda theta: 0 <= theta < 1,
               "THETA, the fraction of frequencies dropped, must be in [0, 1)"),
         Param("N", int, lambda bits: 2 <= bits <= 16 or bits == 32, "N must be 2..16 bits, or 32 for fp32 values")),
        "drop the fraction THETA of the gradient's frequency components, send the rest as N-bit offset floats "
        "(N = 2..16, or 32 for fp32)", f"{_GRAD}.fft:FFTSparsifier",
        replica_computed=True),  # (every replica inverts the mean spectrum: cuFFT)
    "signsgd": MethodKind(
        (), "majority-vote signSGD on a ring of packed vote counts; the update is lr*sign (use SGD; --momentum votes "
        "on the local momentum: Signum)", f"{_GRAD}.signsgd:SignSGD", sign_based=True, clippable=False,
        optimizer="sgd", needs_optimizer_because=SIGN_NEEDS_SGD),
    "marsit": MethodKind(
        (Param("K", int, lambda period: period >= 0, "K must be 0 (never) or a positive number of steps"),),
        "Marsit 1-bit ring with global compensation in update units, full precision every K steps (0: never; use SGD)",
        f"{_GRAD}.marsit:Marsit", sign_based=True, optimizer="sgd", needs_optimizer_because=SIGN_NEEDS_SGD),
}


@dataclass(frozen=True)
class GradSpec:
    """A parsed --grad-sync value: the method's name and its arguments, read and checked."""

    method: str
    args: tuple = ()

    @property
    def kind(self) -> MethodKind:
        return METHODS[self.method]

    @property
    def sign_based(self) -> bool:
        return self.kind.sign_based


def as_grad_spec(value: GradSpec | str) -> GradSpec:
    """A parsed --grad-sync value as it is; its text parsed (for callers of the Python API holding a string)."""
    return value if isinstance(value, GradSpec) else parse_grad_spec(value)


def usage(method: str) -> str:
    """How a value of `method` is written, e.g. sidco:DIST:F."""
    return ":".join((method, *(param.name for param in METHODS[method].params)))


def describe_methods() -> str:
    """One line listing every method and its arguments, for error messages."""
    return "; ".join(usage(name) for name in METHODS)


def describe_methods_help() -> str:
    """Every method with its arguments and what it does, for --help."""
    return "; ".join(f"{usage(name)} ({kind.summary})" for name, kind in METHODS.items())


def parse_grad_spec(text: str) -> GradSpec:
    """Parse `method[:arg…]`, reading and range-checking every argument as its row says."""
    method, *raw = str(text).split(":")
    if method not in METHODS:
        raise GradSpecError(f"--grad-sync {text!r} is not a gradient compressor; use one of {describe_methods()}")
    params = METHODS[method].params
    if len(raw) != len(params):
        raise GradSpecError(f"--grad-sync {text!r}: write it as {usage(method)}")
    args = []
    for param, value in zip(params, raw):
        try:
            arg = param.read(value)
        except ValueError:
            raise GradSpecError(f"--grad-sync {text!r}: {param.name} must be a number") from None
        if not param.allowed(arg):
            raise GradSpecError(f"--grad-sync {text}: {param.rule}")
        args.append(arg)
    return GradSpec(method, tuple(args))


def check_pairing(spec: GradSpec, optimizer: str) -> None:
    """A method that needs one optimizer refuses the others: the sign-based ones are optimizers in effect (the update
    is a sign) and only make sense under SGD; qadam is Adam itself."""
    needed = spec.kind.optimizer
    if needed and optimizer != needed:
        why = spec.kind.needs_optimizer_because.format(given=optimizer)
        raise GradSpecError(f"--grad-sync {spec.method} {why} — use --optimizer {needed}")
