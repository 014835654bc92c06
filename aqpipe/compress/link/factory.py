"""Building and sizing a link codec by its spec: the class `specs.CODEC_KINDS` names for it (imported on first use),
its `from_spec` given what the link's end holds, its `message_bytes` for the capacity plan."""

from __future__ import annotations

import importlib

import torch

from aqpipe.compress.link.base import CodecParts, LinkCodec
from aqpipe.compress.link.options import QuantOptions
from aqpipe.compress.link.specs import CODEC_KINDS, LOSSLESS, CodecError, CodecSpec, first_sight_spec, parse_spec


def build_codec(spec: str | CodecSpec, direction: str = "fw", store_view=None, options: QuantOptions | None = None,
                check: bool = True, device: torch.device | str = "cpu",
                first_sight: str | CodecSpec = LOSSLESS) -> LinkCodec:
    """The codec for a spec, decoding onto `device`; AQ-SGD needs `store_view` (one side of one link of the message
    store) and codes a sample without m(ξ) with `first_sight` (`fp32`: losslessly)."""
    parsed = parse_spec(spec, direction) if isinstance(spec, str) else spec
    if CODEC_KINDS[parsed.kind].keeps_messages and store_view is None:
        raise CodecError(f"the {parsed.kind} codec needs a message store")
    parts = CodecParts(direction, store_view, options or QuantOptions(), check, torch.device(device),
                       first_sight_spec(first_sight))
    codec = codec_class(parsed.kind).from_spec(parsed, parts)
    codec.device = parts.device
    return codec


def codec_class(kind: str) -> type[LinkCodec]:
    """The class implementing codec `kind` (imported on first use)."""
    module, _, name = CODEC_KINDS[kind].implementation.partition(":")
    return getattr(importlib.import_module(module), name)


def message_bytes(spec: str | CodecSpec, direction: str, shape: tuple[int, ...], dtype: torch.dtype,
                  options: QuantOptions, first_sight: str | CodecSpec = LOSSLESS, first_sights: bool = False) -> int:
    """Payload bytes of one compressed message of `shape` with a --fw/--bw spec (see `LinkCodec.message_bytes`)."""
    parsed = parse_spec(spec, direction) if isinstance(spec, str) else spec
    return codec_class(parsed.kind).message_bytes(parsed, shape, dtype, options, first_sight_spec(first_sight),
                                                  first_sights)
