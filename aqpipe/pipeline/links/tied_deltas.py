"""A tied table's rows as B-bit changes, and its gradient rows as B bits with error feedback (`--tied-exchange
rows:delta:B`): the row exchange of `aqpipe.pipeline.links.tied_rows` with AQ-SGD's idea applied to parameters.

The lookup side's table is a cache of the owner's rows. The owner keeps a *mirror*, bit for bit what the lookup side
holds of every row, and sends a row as the rotated-tile quantization (`aqpipe.compress.rotated`, B bits) of its
change since the mirror, not the row: both ends add the same decoded change to the same old values, so the mirror
and the cache stay one tensor (a digest of the two is compared once per process, at a launch or a resume, before
rows first travel), and the owner's next change of the row carries what this one left out. A row the mirror does
not vouch for (the digests differed) goes exactly, in fp32, once. Between two looks at a row the owner's update
moves it by a learning rate's worth, which B bits code finely; the embedding computes on rows within one
quantization step of a small change of the head's.

The gradient rows go as B bits too, unscaled, each row's error kept on the lookup side and added to its next
gradient (error feedback): what a code leaves out is delayed, not dropped. A message whose gradient is not finite
(an fp16 loss-scale overflow) goes exactly; a step that is skipped (an overflow on any rank) leaves the errors as they
were before it. An evaluation's rows are coded against the mirror without the mirror taking them, and the lookup
side puts the rows they overwrote back after the pass: evaluating changes nothing in training. The coder runs op by
op, never from CUDA graphs (the row counts differ from message to message).

Payload of a rows message: one mode byte per row (1: exact), the exact rows in fp32, then the coded changes; of a
gradient message: one mode byte (1: exact), then the exact rows or the coded rows.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch

from aqpipe.compress.gpu.copies import to_device
from aqpipe.compress.link.base import bytes_as
from aqpipe.compress.link.options import QuantOptions
from aqpipe.compress.link.sample_coders import RotatedCoder
from aqpipe.pipeline.links.transport import TransportError

EXACT, CODED = 1, 0


def table_digest(table: torch.Tensor) -> torch.Tensor:
    """SHA-256 of a table's bytes, as 32 uint8 (on the host)."""
    data = table.detach().contiguous().cpu().view(torch.uint8).reshape(-1).numpy()
    return torch.frombuffer(bytearray(hashlib.sha256(data.data).digest()), dtype=torch.uint8)  # (no copy)


@dataclass
class RowDeltas:
    """One end's side of delta-coded rows for a table of `width` columns: on the owner the mirror of the lookup
    side's cache (`mirror`, `known`), on the lookup side the gradient rows' errors (`residual`)."""

    bits: int
    width: int
    coder: RotatedCoder = field(init=False)
    mirror: torch.Tensor | None = None  # owner: what the lookup side holds of each row
    known: torch.Tensor | None = None  # owner: the rows whose mirror is the lookup side's, bit for bit
    residual: torch.Tensor | None = None  # lookup: what each row's coded gradients have left out so far
    _undo: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # lookup: this step's errors before

    def __post_init__(self) -> None:
        if not 2 <= self.bits <= 8:
            raise ValueError(f"delta-coded rows take 2..8 bits, got {self.bits}")
        self.coder = RotatedCoder(self.bits, QuantOptions())

    def row_bytes(self) -> int:
        """Bytes one coded row takes."""
        return self.coder.sample_bytes((1, 1, self.width))

    # -- the owner ------------------------------------------------------------------------------------------------

    def start_owner(self, table: torch.Tensor, lookup_digest: torch.Tensor) -> None:
        """Vouch for every row where the lookup side's cache is the mirror (a fresh start: the mirror is the table
        both sides began with; a resume: the checkpoint's mirror), for none otherwise."""
        if self.mirror is None:
            self.mirror = table.detach().clone()
        same = torch.equal(table_digest(self.mirror), lookup_digest.cpu())
        # (on the host: which rows go exactly decides the payload's layout, which the host writes)
        self.known = torch.full((self.mirror.shape[0],), same, dtype=torch.bool)

    def encode_rows(self, rows: torch.Tensor, current: torch.Tensor, keep: bool = True) -> torch.Tensor:
        """The payload (on `current`'s device) of `rows` (on the host) whose values are now `current`; with `keep`
        the mirror takes what the lookup side will hold (an evaluation's rows: not)."""
        mirror, known = self._mirror()
        rows = rows.cpu()
        exact = ~known[rows]
        device = mirror.device
        exact_at, coded_at = (to_device(where.nonzero().view(-1), device) for where in (exact, ~exact))
        rows_on = to_device(rows, device)
        coded_rows = rows_on[coded_at]
        change = current[coded_at].to(torch.float32) - mirror[coded_rows].to(torch.float32)
        codes, decoded = self._code(change)
        exact_values = current[exact_at].to(torch.float32).contiguous()
        if keep:
            mirror[coded_rows] = mirror[coded_rows] + decoded.to(mirror.dtype)
            mirror[rows_on[exact_at]] = current[exact_at].to(mirror.dtype)
            known[rows] = True
        return torch.cat([to_device(exact.to(torch.uint8), device), exact_values.view(torch.uint8).reshape(-1),
                          codes.reshape(-1)])

    def decode_grads(self, rows: torch.Tensor, payload: torch.Tensor) -> torch.Tensor:
        """The gradient rows a payload stands for (float32 [len(rows), width])."""
        n = len(rows)
        if payload.numel() < 1:
            raise TransportError("a tied table's gradient rows arrived without their mode byte")
        mode, body = int(payload[0]), payload[1:]
        if mode == EXACT:
            _expect_length(body, n * self.width * 4, "exact gradient rows")
            return bytes_as(body.view(1, -1), torch.float32).view(n, self.width)
        _expect_length(body, n * self.row_bytes(), "coded gradient rows")
        return self.coder._decode(body.view(n, -1), (n, 1, self.width)).view(n, self.width)

    # -- the lookup side --------------------------------------------------------------------------------------------

    def decode_rows(self, rows: torch.Tensor, payload: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        """The new values of `rows` (in the cache's dtype) a rows payload stands for, against the `cache` table."""
        n = len(rows)
        if payload.numel() < n:
            raise TransportError(f"a tied table's rows payload of {payload.numel()} bytes lacks its {n} mode bytes")
        exact = payload[:n] == EXACT  # (read where the bytes arrived: which rows are which needs no wait)
        n_exact = int(exact.sum())
        body = payload[n:]
        _expect_length(body, n_exact * self.width * 4 + (n - n_exact) * self.row_bytes(), "rows")
        split = n_exact * self.width * 4
        exact_values = bytes_as(body[:split].view(1, -1), torch.float32).view(n_exact, self.width) if n_exact \
            else torch.zeros(0, self.width)
        device = cache.device
        exact_at, coded_at = (to_device(where.nonzero().view(-1), device) for where in (exact, ~exact))
        values = torch.empty(n, self.width, dtype=cache.dtype, device=device)
        values[exact_at] = to_device(exact_values, device).to(cache.dtype)
        if n_exact < n:
            decoded = self.coder._decode(to_device(body[split:], device).view(n - n_exact, -1),
                                         (n - n_exact, 1, self.width)).view(n - n_exact, self.width)
            values[coded_at] = cache.detach()[to_device(rows, device)[coded_at]] + decoded.to(cache.dtype)
        return values

    def encode_grads(self, rows: torch.Tensor, grads: torch.Tensor, height: int) -> torch.Tensor:
        """The payload (on the gradients' device) of the unscaled gradient rows `grads` of `rows` (a table of `height`
        rows): coded with each row's error added, the new errors kept (`undo_step` puts the step's back); exactly,
        errors untouched, when they are not finite."""
        if not bool(torch.isfinite(grads).all()):  # (the host waits for this: it decides the payload's form)
            exact = grads.to(torch.float32).contiguous().view(torch.uint8).reshape(-1)
            return torch.cat([exact.new_full((1,), EXACT), exact])
        if self.residual is None:
            self.residual = torch.zeros(height, self.width, dtype=torch.float32, device=grads.device)
        rows = to_device(rows, self.residual.device)
        target = grads.to(torch.float32) + self.residual[rows]
        codes, decoded = self._code(target)
        self._undo.append((rows, self.residual[rows].clone()))
        self.residual[rows] = target - decoded
        return torch.cat([codes.new_full((1,), CODED), codes.reshape(-1)])

    def begin_step(self) -> None:
        """A step begins: the errors it changes are remembered from here (`undo_step`)."""
        self._undo.clear()

    def undo_step(self) -> None:
        """The step is skipped: every error it changed goes back to what it was before the step."""
        assert self.residual is not None or not self._undo, "errors changed before they existed"
        for rows, before in reversed(self._undo):
            self.residual[rows] = before  # type: ignore[index]
        self._undo.clear()

    # -- both -------------------------------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """What a checkpoint keeps: the owner's mirror, the lookup side's errors (on the host)."""
        return {k: None if v is None else v.detach().cpu() for k, v in (("mirror", self.mirror),
                                                                       ("residual", self.residual))}

    def load_state_dict(self, state: dict, device: torch.device) -> None:
        """Restore `state_dict`'s output (the owner vouches for rows again once the digests are compared)."""
        self.mirror = None if state.get("mirror") is None else state["mirror"].to(device)
        self.residual = None if state.get("residual") is None else state["residual"].to(device)
        self.known = None

    def _mirror(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.mirror is None or self.known is None:
            raise RuntimeError("delta-coded rows sent before the two ends compared their copies of the table")
        return self.mirror, self.known

    def _code(self, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Coded rows of float32 `values` [n, width] and what they decode to, both on the values' device, decoded from
        the bytes themselves, as the other end decodes them."""
        n = values.shape[0]
        if n == 0:
            return torch.zeros(0, dtype=torch.uint8, device=values.device), values
        shape = (n, 1, self.width)
        codes, _ = self.coder._encode(values.reshape(shape), False)
        decoded = self.coder._decode(codes, shape).view(n, self.width)
        return codes, decoded


def _expect_length(body: torch.Tensor, expected: int, what: str) -> None:
    if body.numel() != expected:
        raise TransportError(f"a tied table's {what} arrived as {body.numel()} bytes, {expected} expected")
