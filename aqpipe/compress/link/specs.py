"""The link codecs, by name: the one table `--fw`/`--bw`, `build_codec` and the CLI help read, and the parser of
a codec spec (no torch import, so the configuration and the help can use it cheaply)."""

from __future__ import annotations

import re
from dataclasses import dataclass


class CodecError(ValueError):
    """A codec spec that cannot be parsed, or a payload that does not fit its codec."""


@dataclass(frozen=True)
class CodecKind:
    """One codec name: its parameters (B = bits 1..8, F = kept fraction), the directions it may serve, its help, the
    class that implements it (`module:Class`, imported only when a codec is built or sized: its `from_spec` builds
    one, its `message_bytes` sizes a message), and what it can do."""

    params: tuple[str, ...]
    directions: tuple[str, ...]
    summary: str
    implementation: str
    keeps_messages: bool = False  # keeps a per-sample m(ξ) on both sides of a link (needs a message store)
    first_sight: bool = False  # codes each sample alone and keeps nothing: may code AQ-SGD's first sights


_CODECS = "aqpipe.compress.link"
CODEC_KINDS: dict[str, CodecKind] = {
    "fp32": CodecKind((), ("fw", "bw"), "lossless", f"{_CODECS}.floats:FloatCodec", first_sight=True),
    "fp16": CodecKind((), ("fw", "bw"), "half precision", f"{_CODECS}.floats:FloatCodec", first_sight=True),
    "bf16": CodecKind((), ("fw", "bw"), "bfloat16", f"{_CODECS}.floats:FloatCodec", first_sight=True),
    "directq": CodecKind(("B",), ("fw", "bw"), "B-bit quantization of the tensor itself",
                         f"{_CODECS}.sample_coders:CoderCodec", first_sight=True),
    "rtq": CodecKind(("B",), ("fw", "bw"), "B-bit rotated tile quantization: a 64-channel Hadamard rotation, "
                     "one fp16 scale per tile of a token", f"{_CODECS}.sample_coders:CoderCodec", first_sight=True),
    "rtqo": CodecKind(("B",), ("fw", "bw"), "rtq:B with each token's largest value set apart, sent in fp16 with its "
                      "channel (4 bytes a token): a massive activation exact, the rest of its tile finely quantized",
                      f"{_CODECS}.sample_coders:CoderCodec", first_sight=True),
    "tahq": CodecKind((), ("fw",), "TAH-Quant (arXiv 2506.01352) as published, a baseline: 4 bits, 3 for "
                      "the 20% lowest-entropy tokens, Hadamard-rotated outlier tiles, fp16 zero and step per 64-tile",
                      f"{_CODECS}.tahq:TAHQuantCodec"),
    "aqsgd": CodecKind(("B",), ("fw",), "AQ-SGD: B-bit quantization of the change since the sample's last visit",
                       f"{_CODECS}.aqsgd:AQSGDCodec", keeps_messages=True),
    "aqsgd-rtq": CodecKind(("B",), ("fw",), "AQ-SGD whose changes go through rtq:B (rotated tiles) instead",
                           f"{_CODECS}.aqsgd:AQSGDCodec", keeps_messages=True),
    "topk": CodecKind(("F", "B"), ("bw",), "keep the largest fraction F, B-bit values", f"{_CODECS}.topk:TopKCodec"),
}
# what --first-sight accepts: the codecs that code each sample alone and keep nothing between messages
FIRST_SIGHT_KINDS = tuple(name for name, kind in CODEC_KINDS.items() if kind.first_sight)
# An AQ-SGD link's first sights when --first-sight is not given, with no fp32 warm-up epoch (--warmup-epochs 0):
# chosen by the SmolLM2 fine-tuning benchmark (benchmarks/README.md, "Fine-tuning from the first step"). Coded first
# sights from step 1 compress a 1-epoch fine-tune throughout (an fp32 first epoch sends every byte of it uncoded) at a
# held-out loss within 1% of fp32's; over real rows, rtqo:3 (each token's largest value set apart in fp16, the rest
# in rotated 3-bit tiles) held it within 0.04% at 1 epoch, 0.57% and 1.1% below it at 2 and 3, at 11%, 6% and 4%
# fewer bytes than rtq:4 (+0.20%, +0.22%, -0.23%). A link that keeps no messages has no first sights: fp32.
DEFAULT_FIRST_SIGHT = "rtqo:3"
# The link codecs when --fw/--bw are not given: chosen by the same benchmark: AQ-SGD's 3-bit deltas forward and
# rotated 4-bit gradients back, with rtqo:3 first sights and only real tokens on the links, moved 13.95-13.99x fewer
# link bytes than fp32 links sending every position over 1, 2 and 3 epochs (8.47-8.49x fewer than fp32 sending the
# same real tokens), within 1% of fp32's held-out loss; aqsgd:4 / directq:8 moves about 5.2x (every
# position), its 8-bit gradients two thirds of its bytes.
DEFAULT_FW, DEFAULT_BW = "aqsgd:3", "rtq:4"
# How held-out activations cross the links when --eval-codec is not given: chosen by the SmolLM2 fine-tuning benchmark
# (benchmarks/README.md, "Evaluation through the codecs"): on the pretrained and on fine-tuned weights, rtqo:7 put the
# held-out loss within 0.05% of the same weights' loss over fp32 links at 4.4x fewer bytes; rtqo:6 (5.1x) was 0.22%
# off on the pretrained weights, as far as the differences between link settings a user evaluates to compare, and
# rtq:4 (7.5x) up to 1%: SmolLM2's attention-sink token carries a massive activation (~25,000) that 4-bit tiles
# cannot code beside its ordinary channels.
DEFAULT_EVAL_CODEC = "rtqo:7"


@dataclass(frozen=True)
class CodecSpec:
    """A parsed `--fw`/`--bw` value."""

    kind: str  # a key of CODEC_KINDS
    bits: int = 0
    fraction: float = 1.0

    @property
    def keeps_messages(self) -> bool:
        """Whether this codec keeps a per-sample m(ξ) on both sides of its link (AQ-SGD)."""
        return CODEC_KINDS[self.kind].keeps_messages

    @property
    def lossless(self) -> bool:
        """Whether this is `fp32`: as a first-sight coder, a first sight goes in the activation's own dtype."""
        return self.kind == "fp32"

    def __str__(self) -> str:
        if self.kind == "topk":
            return f"topk:{self.fraction:g}:{self.bits}"
        return f"{self.kind}:{self.bits}" if self.bits else self.kind


def usage(kind: str) -> str:
    """How a spec of `kind` is written, e.g. topk:F:B."""
    return ":".join((kind, *CODEC_KINDS[kind].params))


def kinds_for(direction: str) -> list[str]:
    """The codec names the forward ("fw") or backward ("bw") direction accepts."""
    return [name for name, kind in CODEC_KINDS.items() if direction in kind.directions]


def describe_codecs(direction: str) -> str:
    """The codecs of one direction for --help."""
    return "; ".join(f"{usage(name)} ({CODEC_KINDS[name].summary})" for name in kinds_for(direction))


def parse_spec(spec: str, direction: str) -> CodecSpec:
    """Parse and validate a codec spec for the forward ("fw") or backward ("bw") direction."""
    flag, allowed = f"--{direction}", kinds_for(direction)
    kind, *args = spec.split(":")
    if kind not in allowed:
        raise CodecError(f"{flag} {spec!r} is not a {'forward' if direction == 'fw' else 'backward'} codec; use "
                         f"{', '.join(usage(k) for k in allowed)} (B = 1..8 bits)")
    params = CODEC_KINDS[kind].params
    if not params:
        if args:
            raise CodecError(f"{flag} {spec!r}: {kind} takes no parameters")
        return CodecSpec(kind)
    if len(args) != len(params):
        raise CodecError(f"{flag} {spec!r} must look like {usage(kind)}")
    if not re.fullmatch(r"\d+", args[-1]) or not 1 <= int(args[-1]) <= 8:
        raise CodecError(f"{flag} {spec!r}: bits must be an integer in 1..8")
    fraction = 1.0
    if "F" in params:
        try:
            fraction = float(args[0])
        except ValueError:
            raise CodecError(f"{flag} {spec!r}: the kept fraction F must be a number in (0, 1]") from None
        if not 0.0 < fraction <= 1.0:
            raise CodecError(f"{flag} {spec!r}: the kept fraction F must be in (0, 1], got {args[0]}")
    return CodecSpec(kind, int(args[-1]), fraction)


def check_first_sight(spec: str) -> CodecSpec:
    """Parse a --first-sight spec (a CodecError naming the choices if it is not one)."""
    return check_sample_coder(spec, "--first-sight", "a first-sight coder")


def check_eval_codec(spec: str) -> CodecSpec:
    """Parse an --eval-codec spec (a CodecError naming the choices if it is not one)."""
    return check_sample_coder(spec, "--eval-codec", "an evaluation codec (one that codes each sample alone)")


def check_sample_coder(spec: str, flag: str, what: str) -> CodecSpec:
    """Parse the spec of a codec that codes each sample alone and keeps nothing (FIRST_SIGHT_KINDS) given to `flag`
    (a CodecError naming the choices if it is not `what`)."""
    try:
        parsed: CodecSpec | None = parse_spec(spec, "fw")
    except CodecError:
        parsed = None
    if parsed is None or parsed.kind not in FIRST_SIGHT_KINDS:
        raise CodecError(f"{flag} {spec!r} is not {what}; use "
                         f"{', '.join(usage(kind) for kind in FIRST_SIGHT_KINDS)} (B = 1..8 bits)")
    return parsed


def first_sight_spec(first_sight: str | CodecSpec) -> CodecSpec:
    """A --first-sight value parsed (a CodecSpec passes as it is)."""
    return first_sight if isinstance(first_sight, CodecSpec) else check_first_sight(first_sight)


LOSSLESS = CodecSpec("fp32")  # the first-sight coder that sends a sample's values as they are
