"""Real rows: only the positions a sample's attention mask marks cross a link (`--link-rows real`).

Nothing downstream reads a padded position's activation (no real position attends to it, its loss term is
ignored), and its gradient is exactly zero, so a batch [B, T, ...] with a mask [B, T] need not send them. The
samples of a message are grouped by their count of real rows; each group goes through the link's codec as a batch
of its own, [b, L, ...] holding only its samples' real rows in order (so a codec, and AQ-SGD's m(ξ), only ever see
real rows: m(ξ) of a sample is its L real rows, visit after visit). The payload is a directory — per group its
payload length, codec check, flags and wire dtype — then each group's payload in order. The receiver knows every
sample's real positions from the mask (an activation carries it; a gradient's receiver sent it the activation), and
rebuilds the padded tensor with zeros where nothing was sent. A sample with no real row sends nothing; a batch with
no padding, or none of whose samples has a real row, goes as an ordinary message.

With lossless links the trained model is the padded links' bit for bit: every real value arrives unchanged, and
what differs at padded positions (zeros instead of what was computed there) reaches no real position.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
import struct
from collections.abc import Callable
from dataclasses import dataclass

import torch

from aqpipe.compress.gpu import cuda_graphs
from aqpipe.compress.link.base import DeltaFidelity, Encoded, LinkCodec
from aqpipe.compress.link.codes import FLAG_REAL_ROWS
from aqpipe.pipeline.links.transport import DTYPE_CODES, DTYPES, Header, TransportError

# a group's entry in the directory: its payload length, codec check, flags and wire dtype code
ENTRY = struct.Struct("<qIIB7x")


@dataclass
class RealRows:
    """Where a batch's real rows are: its padded shape, and its groups — samples with the same count of real rows,
    as (their indices in the batch [b], their real positions [b, L]), in order of each group's first sample."""

    shape: tuple[int, ...]
    groups: list[tuple[torch.Tensor, torch.Tensor]]

    @classmethod
    def of(cls, mask: torch.Tensor | None, shape: tuple[int, ...]) -> RealRows | None:
        """The real rows a `mask` [B, T] (nonzero: a real position) marks in a batch of `shape` [B, T, ...]; None
        where a message of that batch goes padded: no mask, one that does not describe the batch, no padding, or no
        real row at all."""
        if mask is None or len(shape) < 3 or tuple(mask.shape) != tuple(shape[:2]):
            return None
        real = mask.detach().cpu() != 0
        lengths = real.sum(dim=1)
        if bool((lengths == shape[1]).all()) or not bool(lengths.any()):
            return None
        by_length: dict[int, list[int]] = {}
        for i, length in enumerate(lengths.tolist()):
            if length:
                by_length.setdefault(length, []).append(i)
        groups = []
        for length, samples in by_length.items():
            index = torch.tensor(samples, dtype=torch.int64)
            positions = real[index].nonzero()[:, 1].view(len(samples), length)  # (row-major: each sample's in order)
            groups.append((index, positions))
        return cls(tuple(shape), groups)

    def real_count(self) -> int:
        """Real rows in the batch."""
        return sum(positions.numel() for _, positions in self.groups)

    def gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Each group's real rows of `x` [B, T, ...], as a batch [b, L, ...] of its own."""
        return [x[on(index, x.device)[:, None], on(positions, x.device)] for index, positions in self.groups]

    def scatter(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """The padded batch whose real rows are `parts` (as `gather` gave them), zeros elsewhere."""
        first = parts[0]
        out = torch.zeros(self.shape, dtype=first.dtype, device=first.device)
        for (index, positions), part in zip(self.groups, parts):
            out[on(index, out.device)[:, None], on(positions, out.device)] = part.to(out.dtype)
        return out


def on(index: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host index on `device`: for a GPU through page-locked memory, a copy the host does not wait for (from
    pageable memory the copy would hold the host until the GPU had done all it was given)."""
    if device.type == "cpu":
        return index
    return index.pin_memory().to(device, non_blocking=True)


@dataclass
class Grouped:
    """A batch's groups encoded: the directory (uint8, on the host) and each group's encoded payload."""

    directory: torch.Tensor
    parts: list[Encoded]

    @property
    def payload_len(self) -> int:
        """The groups' payload bytes (the directory aside: it is framing)."""
        return sum(part.payload_len for part in self.parts)

    @property
    def fidelity(self) -> DeltaFidelity | None:
        """AQ-SGD's deltas against the truth, summed over the groups that sent some."""
        known = [part.fidelity for part in self.parts if part.fidelity is not None]
        return functools.reduce(operator.add, known) if known else None


def encode(codec: LinkCodec, x: torch.Tensor, ids: torch.Tensor, compress: bool, rows: RealRows) -> Grouped:
    """Each group of `x`'s real rows through `codec` (with its samples' ids), and the directory of the message. On a
    GPU the codec runs op by op: its groups' shapes change from message to message, so CUDA graphs of them would be
    captured for few replays, each holding buffers of its own."""
    with cuda_graphs.op_by_op():
        parts = [codec.encode(values, ids[index], compress) for values, (index, _) in zip(rows.gather(x), rows.groups)]
    directory = b"".join(ENTRY.pack(part.payload_len, part.codec_check, part.flags, DTYPE_CODES[part.wire_dtype])
                         for part in parts)
    return Grouped(torch.frombuffer(bytearray(directory), dtype=torch.uint8), parts)


def header_of(grouped: Grouped, codec: LinkCodec, kind: int, step: int, micro_batch: int, shape: tuple[int, ...],
              n_ids: int, side_kind: int) -> Header:
    """The header of a real-rows message: the padded shape, the codec's identity, and the real-rows flag."""
    return Header(kind, step, micro_batch, tuple(shape), torch.uint8, n_ids,
                  grouped.directory.numel() + grouped.payload_len, codec=codec.code,
                  flags=codec.flags() | FLAG_REAL_ROWS, side_kind=side_kind)


def accepting(codec: LinkCodec) -> Callable[[Header], str | None]:
    """The header check of a link end decoding with `codec`: a real-rows message must name the codec and hold a batch
    (its groups are checked against the codec once the mask is known); any other goes to the codec's own check."""

    def check(header: Header) -> str | None:
        if not header.flags & FLAG_REAL_ROWS:
            return codec.check_header(header)
        if problem := codec.identity_problem(dataclasses.replace(header, flags=header.flags & ~FLAG_REAL_ROWS)):
            return problem
        if len(header.shape) < 3 or header.shape[0] != header.n_ids or header.dtype != torch.uint8:
            return (f"a real-rows message holds a batch [samples, positions, ...] of bytes, one id a sample, not "
                    f"{header.dtype} of shape {header.shape} with {header.n_ids} ids")
        return None

    return check


def decode(codec: LinkCodec, header: Header, payload: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor | None,
           peer: str) -> torch.Tensor:
    """The padded batch a real-rows message stands for, its groups decoded by `codec` where the `mask` [B, T] of the
    batch says they lie; a TransportError naming `peer` if the message does not fit the mask or the codec."""
    rows = RealRows.of(mask, header.shape)
    if rows is None:
        raise TransportError(f"malformed message from {peer}: real rows of a batch of shape {header.shape} without a "
                             f"mask that pads it")
    size = ENTRY.size * len(rows.groups)
    directory = payload[:size].numpy().tobytes() if payload.numel() >= size else b""
    entries = [ENTRY.unpack_from(directory, i * ENTRY.size) for i in range(len(rows.groups))] if directory else []
    if not entries or size + sum(entry[0] for entry in entries) != payload.numel():
        raise TransportError(f"malformed message from {peer}: its real rows do not match the {len(rows.groups)} "
                             f"groups the mask makes ({payload.numel()} bytes)")
    parts, offset = [], size
    with cuda_graphs.op_by_op():  # (as `encode`)
        for (index, positions), (length, check, flags, dtype_code) in zip(rows.groups, entries):
            if dtype_code not in DTYPES:
                raise TransportError(f"malformed message from {peer}: unknown dtype code {dtype_code} in its real rows")
            group = dataclasses.replace(header, shape=(*positions.shape, *header.shape[2:]), dtype=DTYPES[dtype_code],
                                        n_ids=index.numel(), payload_len=length, codec_check=check, flags=flags)
            if problem := codec.check_header(group):
                raise TransportError(f"malformed message from {peer}: a group of its real rows: {problem}")
            parts.append(codec.decode(group, payload[offset:offset + length], ids[index]))
            offset += length
    return rows.scatter(parts)
