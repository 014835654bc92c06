"""The gradient compressors, by name: the one table `--grad-sync`, `build_grad_sync` and the CLI help read, with
the parser of a `--grad-sync` value (no torch import, so the configuration and the help can use it cheaply)."""

from __future__ import annotations

from dataclasses import dataclass

# name -> (argument names, the help line)
METHODS = {
    "none": ((), "fp32 all-reduce average"),
    "fp16": ((), "average all-reduced in fp16"),
    "bf16": ((), "average all-reduced in bf16"),
    "powersgd": (("R",), "rank-R PowerSGD with error feedback (torch's own hook)"),
    "ef": (("B",), "B-bit quantized gradients with error feedback, all-gathered"),
    "qadam": (("B",), "QuantizedAdam: AdamW warm-up on fp32 averages, then frozen v and the momentum exchanged "
                      "B-bit with worker and server error feedback (use AdamW)"),
    "topk": (("F",), "largest fraction F of the gradient with error feedback, values and indices all-gathered"),
    "sidco": (("DIST", "F"), "SIDCo: keep about the fraction F above a threshold read off a fitted distribution "
                            "DIST = exp, gamma or gpareto (multi-stage, adaptive), error feedback"),
    "fft": (("THETA", "N"), "drop the fraction THETA of the gradient's frequency components, send the rest as N-bit "
                             "offset floats (N = 2..16, or 32 for fp32)"),
    "signsgd": ((), "majority-vote signSGD on a ring of packed vote counts; the update is lr*sign (use SGD; "
                    "--momentum votes on the local momentum: Signum)"),
    "marsit": (("K",), "Marsit 1-bit ring with global compensation in update units, full precision every K steps "
                       "(0: never; use SGD)"),
}
SIGN_BASED = ("signsgd", "marsit")
# fp32 copies of a stage's trained parameters a method keeps from step to step where the replicas' collectives run (a
# GPU under NCCL, else the host): error feedback's residual, PowerSGD's error and its factors (R·(m + n) values of an
# m × n matrix, which torch's hook factors only where that is at most half of it), Marsit's compensation, qadam's
# worker residual (its server residual, a 1/dp chunk, comes on top); the others keep none
KEPT_COPIES = {"powersgd": 1.5, "ef": 1.0, "qadam": 1.0, "topk": 1.0, "sidco": 1.0, "marsit": 1.0}
# fp32 copies of the trained parameters a replica's grad sync holds at its peak, its kept state included (qadam's in
# the optimizer's momentum exchange), at least: measured on gloo ranks with every storage its ops make counted and
# every buffer a collective sends held to the end, at 1-4 replicas; the messages a method gathers add their share
# per replica (`sync_copies`). tests/test_grad_methods.py holds the table to what the code does.
PEAK_COPIES = {"none": 1.0, "fp16": 2.5, "bf16": 2.5, "powersgd": 4.1, "ef": 8.6, "qadam": 9.1, "topk": 5.1,
               "sidco": 5.1, "fft": 8.2, "signsgd": 5.8, "marsit": 11.1}
QADAM_ALONE = 3.1  # qadam's step at dp 1 (the sign-based methods' vote holds at dp 1 what it holds with replicas)
# What a grad sync staged through the host (gloo, ranks sharing a GPU) holds on the GPU: the flat gradient and its
# result; qadam's step, its momentum, the averaged one and the step's denominator
GLOO_GPU_COPIES = {"qadam": 3.0}
GLOO_GPU_DEFAULT = 2.0


class GradSpecError(ValueError):
    """A --grad-sync value that names no method or gives it bad arguments; the text says what is allowed."""


@dataclass(frozen=True)
class GradSpec:
    """A parsed --grad-sync value."""

    method: str
    args: tuple = ()

    @property
    def sign_based(self) -> bool:
        return self.method in SIGN_BASED


def describe_methods() -> str:
    """One line listing every method and its arguments, for error messages."""
    return "; ".join(name + "".join(f":{a}" for a in args) for name, (args, _) in METHODS.items())


def describe_methods_help() -> str:
    """Every method with its arguments and what it does, for --help."""
    return "; ".join(name + "".join(f":{a}" for a in args) + f" ({text})" for name, (args, text) in METHODS.items())


def parse_grad_spec(text: str) -> GradSpec:
    """Parse `method[:arg…]`, checking every argument's range."""
    method, *raw = str(text).split(":")
    if method not in METHODS:
        raise GradSpecError(f"--grad-sync {text!r} is not a gradient compressor; use one of {describe_methods()}")
    names = METHODS[method][0]
    if len(raw) != len(names):
        usage = method + "".join(f":{a}" for a in names)
        raise GradSpecError(f"--grad-sync {text!r}: write it as {usage}")
    try:
        if method == "powersgd":
            (rank,) = [int(x) for x in raw]
            if rank < 1:
                raise GradSpecError(f"--grad-sync {text}: the rank R must be at least 1")
            return GradSpec(method, (rank,))
        if method in ("ef", "qadam"):
            (bits,) = [int(x) for x in raw]
            if not 1 <= bits <= 8:
                raise GradSpecError(f"--grad-sync {text}: B must be 1..8 bits")
            return GradSpec(method, (bits,))
        if method == "topk":
            (fraction,) = [float(x) for x in raw]
            if not 0 < fraction <= 1:
                raise GradSpecError(f"--grad-sync {text}: the kept fraction F must be in (0, 1]")
            return GradSpec(method, (fraction,))
        if method == "sidco":
            distribution, fraction = raw[0], float(raw[1])
            if distribution not in ("exp", "gamma", "gpareto"):
                raise GradSpecError(f"--grad-sync {text}: DIST must be exp, gamma or gpareto")
            if not 0 < fraction < 1:
                raise GradSpecError(f"--grad-sync {text}: the target fraction F must be in (0, 1)")
            return GradSpec(method, (distribution, fraction))
        if method == "fft":
            theta, bits = float(raw[0]), int(raw[1])
            if not 0 <= theta < 1:
                raise GradSpecError(f"--grad-sync {text}: THETA, the fraction of frequencies dropped, must be in [0, 1)")
            if not (2 <= bits <= 16 or bits == 32):
                raise GradSpecError(f"--grad-sync {text}: N must be 2..16 bits, or 32 for fp32 values")
            return GradSpec(method, (theta, bits))
        if method == "marsit":
            (period,) = [int(x) for x in raw]
            if period < 0:
                raise GradSpecError(f"--grad-sync {text}: K must be 0 (never) or a positive number of steps")
            return GradSpec(method, (period,))
    except ValueError as e:
        if isinstance(e, GradSpecError):
            raise
        raise GradSpecError(f"--grad-sync {text!r}: {', '.join(names)} must be a number") from None
    return GradSpec(method)


def check_pairing(spec: GradSpec, optimizer: str) -> None:
    """Sign-based methods are optimizers in effect (the update is a sign): they only make sense under SGD; qadam
    is Adam itself."""
    if spec.sign_based and optimizer != "sgd":
        raise GradSpecError(f"--grad-sync {spec.method} makes the update lr*sign, an optimizer in itself; "
                            f"--optimizer {optimizer} would rescale the signs — use --optimizer sgd")
    if spec.method == "qadam" and optimizer != "adamw":
        raise GradSpecError(f"--grad-sync qadam is a compressed Adam; --optimizer {optimizer} cannot run it — "
                            f"use --optimizer adamw")


def sync_copies(text: str, dp: int) -> tuple[float, float]:
    """fp32 copies of a stage's trained parameters one replica's grad sync holds where its collectives run: (what it
    keeps from step to step, the most it holds at once while it runs, that included). Nothing without replicas, but
    for the sign-based methods and qadam, which run on one replica too."""
    spec = parse_grad_spec(text)
    if dp < 2:  # nothing to exchange: only a vote (Marsit's with its compensation) and qadam's step run alone
        if spec.sign_based:
            return KEPT_COPIES.get(spec.method, 0.0), PEAK_COPIES[spec.method]
        return 0.0, (QADAM_ALONE if spec.method == "qadam" else 0.0)
    kept = KEPT_COPIES.get(spec.method, 0.0) + (1 / dp if spec.method == "qadam" else 0.0)
    peak = PEAK_COPIES[spec.method]
    if spec.method == "ef":  # every replica's B-bit message
        peak += dp * spec.args[0] / 32
    elif spec.method in ("topk", "sidco"):  # the kept fraction F, its values and indices, and every replica's
        fraction = spec.args[-1]
        peak += 9 * fraction + 2.5 * fraction * dp
    elif spec.method == "fft":  # every replica's spectrum, a fraction 1 − THETA of a copy while sent in fp32
        theta, bits = spec.args
        peak = max(peak if bits < 32 else 0.0, 4.3 + (dp + 1) * (1 - theta))
    return kept, peak


def gloo_gpu_copies(text: str) -> float:
    """fp32 copies of the trained parameters a grad sync staged through the host holds on the GPU at its peak."""
    return GLOO_GPU_COPIES.get(parse_grad_spec(text).method, GLOO_GPU_DEFAULT)
