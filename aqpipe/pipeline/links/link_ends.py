"""Link ends: one direction of one link as one rank sees it.

A rank of stage k touches two links: link k - 1 (it receives activations from stage k - 1 and sends gradients back)
and link k (it sends activations to stage k + 1 and receives gradients back). Each of those four directions is one
end here. An end owns its codec (and through an AQ-SGD codec its view of the m(ξ) store), its mailbox, its byte
and time counters, its half of the re-seed protocol, and the device boundary: what it receives comes back on the
stage's device, what it sends leaves from wherever the tensor lives.

The re-seed protocol of link k: the receiving end of its activations knows which of the next step's samples it
lacks an m(ξ) for (never seen, or found damaged and dropped); that list rides, as a typed re-seed request, on the
last gradient of the step that goes back up the link; the sending end of the activations drops its own copy of
those samples, so it sends them at full precision and seeds both copies again. The last gradient of a step
crosses after every forward of that step under every schedule, so the request is always about the next step.
`StageLinks` puts a rank's ends together and is what the worker talks to.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from aqpipe.compress.link.base import DeltaFidelity, LinkCodec
from aqpipe.compress.link.codes import FLAG_REAL_ROWS
from aqpipe.compress.link.factory import build_codec
from aqpipe.compress.link.specs import LOSSLESS, CodecError
from aqpipe.pipeline import present
from aqpipe.pipeline.links import real_rows
from aqpipe.pipeline.links.tied_rows import RowExchange
from aqpipe.pipeline.links.transport import (
    HEADER_SIZE,
    KIND_EVAL,
    SIDE_MASK,
    SIDE_NONE,
    SIDE_RESEED,
    Expect,
    Header,
    Inbox,
    Message,
    Outbox,
    TransportError,
)
from aqpipe.pipeline.vocab import schedule as sch

FP32: LinkCodec = build_codec(LOSSLESS, "fw")  # an evaluation codec where none is given: lossless


@dataclass
class LinkCounters:
    """What one end moved since the counters were last taken."""

    payload_bytes: int = 0  # sent: payload bytes (headers, ids and side information aside)
    framing_bytes: int = 0  # sent: each message's header, sample ids and attention mask
    control_bytes: int = 0  # sent: re-seed requests riding on gradients
    elements: int = 0  # sent: the tensor values those bytes stood for
    body_bytes: int = 0  # received: message bodies
    arrived_bytes: int = 0  # received: what of those bodies arrived while timed, and the time (`Message`): the rate
    wire_seconds: float = 0.0
    fidelity: DeltaFidelity | None = None  # sent: AQ-SGD's deltas against the truth, summed


@dataclass
class SendEnd:
    """The sending end of one direction of one link: encodes, queues on its outbox, counts."""

    link: int
    kind: int
    codec: LinkCodec
    outbox: Outbox
    counters: LinkCounters = field(default_factory=LinkCounters)
    real_rows: bool = False  # a masked batch sends only its real rows (`aqpipe.pipeline.links.real_rows`)

    def _send(self, step: int, mb: int, tensor: torch.Tensor, ids: torch.Tensor, compress: bool,
              side: torch.Tensor | None = None, side_kind: int = SIDE_NONE, kind: int | None = None,
              codec: LinkCodec | None = None, mask: torch.Tensor | None = None) -> tuple[int, int]:
        """Encode `tensor` (with `real_rows`, only the rows its batch's `mask` marks real) and queue it with its side
        information; returns the payload bytes and the values they stand for (the rest of the message is counted
        here: framing, or control for a re-seed request)."""
        codec = codec or self.codec
        side_kind = side_kind if side is not None else SIDE_NONE
        kind = kind or self.kind
        rows = real_rows.RealRows.of(mask, tuple(tensor.shape)) if self.real_rows else None
        if rows is None:
            with torch.autocast(tensor.device.type, enabled=False):  # (a stage's autocast must not reach the codec)
                encoded = codec.encode(tensor.detach(), ids, compress)
            header = Header.for_encoded(encoded, codec.code, kind, step, mb, ids.numel(), side_kind)
            self.outbox.send(header, ids, encoded.host, side, encoded.ready)
            payload, fidelity, directory, values = encoded.payload_len, encoded.fidelity, 0, tensor.numel()
        else:
            with torch.autocast(tensor.device.type, enabled=False):
                grouped = real_rows.encode(codec, tensor.detach(), ids, compress, rows)
            header = real_rows.header_of(grouped, codec, kind, step, mb, tuple(tensor.shape), ids.numel(), side_kind)
            self.outbox.send(header, ids, [grouped.directory, *(part.host for part in grouped.parts)], side,
                             [None, *(part.ready for part in grouped.parts)])
            payload, fidelity, directory = grouped.payload_len, grouped.fidelity, grouped.directory.numel()
            values = rows.real_count() * tensor[0, 0].numel()
        side_bytes = 0 if side is None else side.numel() * side.element_size()
        self.counters.framing_bytes += HEADER_SIZE + 8 * ids.numel() + directory + (
            0 if side_kind == SIDE_RESEED else side_bytes)
        self.counters.control_bytes += side_bytes if side_kind == SIDE_RESEED else 0
        if fidelity is not None:
            sofar = self.counters.fidelity
            self.counters.fidelity = fidelity if sofar is None else sofar + fidelity
        return payload, values

    def flush(self) -> None:
        """Wait until everything queued has left."""
        self.outbox.flush()

    def close(self, abort: bool = False) -> None:
        """Send what is queued, then close the stream (with `abort`, close at once)."""
        self.outbox.close(abort)


@dataclass
class RecvEnd:
    """The receiving end of one direction of one link: posts what it expects, decodes onto the stage's device."""

    link: int
    kind: int
    codec: LinkCodec
    inbox: Inbox
    device: torch.device
    micro_batch_size: int
    side_kinds: tuple[int, ...] = ()
    counters: LinkCounters = field(default_factory=LinkCounters)
    blocked_seconds: float = 0.0  # so far: time spent waiting for a message to arrive (its decoding aside)

    def post(self, step: int, mb: int) -> None:
        """Announce micro-batch `mb` of `step`; the inbox thread starts receiving it at once."""
        self.inbox.expect(Expect(self.kind, step, mb, self.micro_batch_size, check=real_rows.accepting(self.codec),
                                 side_kinds=self.side_kinds))

    def _receive(self, codec: LinkCodec | None = None, mask: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, Message]:
        """The next message, decoded on the stage's device, and the message itself; a training message (no
        `codec` given) is counted, an evaluation message is not (evaluation runs between steps). A message of real
        rows is rebuilt where `mask` [B, T] says they lie."""
        start = time.perf_counter()
        msg = self.inbox.get()
        self.blocked_seconds += time.perf_counter() - start
        if codec is None:
            self.counters.body_bytes += msg.wire_bytes - HEADER_SIZE
            self.counters.arrived_bytes += msg.arrived_bytes
            self.counters.wire_seconds += msg.transfer_seconds
        codec = codec or self.codec
        with torch.autocast(self.device.type, enabled=False):  # (evaluation receives inside the stage's autocast)
            if msg.header.flags & FLAG_REAL_ROWS:
                if mask is None and msg.header.side_kind == SIDE_MASK:  # (an activation carries its mask)
                    mask = per_sample(msg.side, msg.ids)
                value = real_rows.decode(codec, msg.header, msg.payload, msg.ids, mask, self.inbox.peer_name)
            else:
                value = codec.decode(msg.header, msg.payload, msg.ids)
        return value.to(self.device), msg

    def close(self) -> None:
        """Stop the inbox thread once it has nothing more to receive."""
        self.inbox.close()


@dataclass
class ActivationOut(SendEnd):
    """Stage k's end of link k, forward: the sender side of link k's m(ξ); held-out activations go through
    `eval_codec` (one that codes each sample alone: evaluation never touches the training codec or m(ξ))."""

    eval_codec: LinkCodec = FP32

    def send(self, step: int, mb: int, activation: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor | None,
             compress: bool) -> None:
        """Send micro-batch `mb`'s output (with its attention mask, losslessly, as bytes of 0 and 1)."""
        mask = binary(mask)
        payload, values = self._send(step, mb, activation, ids, compress, mask, SIDE_MASK, mask=mask)
        self.counters.payload_bytes += payload
        self.counters.elements += values

    def send_eval(self, step: int, mb: int, activation: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor | None
                  ) -> int:
        """Send an evaluation activation through the evaluation codec, never the link's training codec or m(ξ);
        returns its bytes (all of the message: evaluation traffic is counted whole, not in the training counters)."""
        framing, control = self.counters.framing_bytes, self.counters.control_bytes
        mask = binary(mask)
        payload, _ = self._send(step, mb, activation, ids, True, mask, SIDE_MASK, KIND_EVAL, self.eval_codec, mask)
        sent = payload + self.counters.framing_bytes - framing
        self.counters.framing_bytes, self.counters.control_bytes = framing, control
        return sent

    def forget(self, ids: list[int]) -> None:
        """The sender half of re-seeding: drop m(ξ) of samples the receiver lacks, so they next go in full."""
        if ids:
            self.codec.forget(ids)


@dataclass
class ActivationIn(RecvEnd):
    """Stage k + 1's end of link k, forward: the receiver side of link k's m(ξ); held-out activations are decoded
    by `eval_codec`."""

    eval_codec: LinkCodec = FP32
    # samples that came as real rows without a real row: nothing of theirs is ever sent or kept, so no re-seed asks
    # for their m(ξ)
    rowless: set[int] = field(default_factory=set)

    def receive(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The next activation (on the stage's device, requiring grad), its sample ids and its mask."""
        x, msg = self._receive()
        mask = per_sample(msg.side, msg.ids)
        if msg.header.flags & FLAG_REAL_ROWS and mask is not None:
            self.rowless.update(msg.ids[(mask.view(len(msg.ids), -1) == 0).all(dim=1)].tolist())
        return x.requires_grad_(True), msg.ids, mask

    def post_eval(self, step: int, mb: int, n_ids: int) -> None:
        """Announce an evaluation activation of `n_ids` samples."""
        self.inbox.expect(Expect(KIND_EVAL, step, mb, n_ids, check=real_rows.accepting(self.eval_codec),
                                 side_kinds=(SIDE_MASK,)))

    def receive_eval(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The next evaluation activation, its sample ids and its mask."""
        x, msg = self._receive(self.eval_codec)
        return x, msg.ids, per_sample(msg.side, msg.ids)

    def missing(self, next_ids: list[int] | None) -> list[int]:
        """The receiver half of re-seeding: those of the next step's samples whose m(ξ) this side lacks."""
        return [i for i in self.codec.missing(next_ids) if i not in self.rowless] if next_ids else []


class GradientOut(SendEnd):
    """Stage k + 1's end of link k, backward."""

    def send(self, step: int, mb: int, grad: torch.Tensor, ids: torch.Tensor, compress: bool,
             reseed: list[int] | None = None, mask: torch.Tensor | None = None) -> None:
        """Send micro-batch `mb`'s input gradient (of a batch padded as `mask` says), with a re-seed request when
        there is one."""
        request = torch.tensor(reseed, dtype=torch.int64) if reseed else None
        payload, values = self._send(step, mb, grad, ids, compress, request, SIDE_RESEED, mask=binary(mask))
        self.counters.payload_bytes += payload
        self.counters.elements += values


class GradientIn(RecvEnd):
    """Stage k's end of link k, backward."""

    def receive(self, mask: torch.Tensor | None = None) -> tuple[torch.Tensor, list[int]]:
        """The next output gradient (on the stage's device; of a batch padded as `mask`, the one its activation
        went with, says) and the re-seed request it carried (often empty)."""
        grad, msg = self._receive(mask=mask)
        return grad, ([] if msg.side is None else msg.side.view(torch.int64).tolist())


def binary(mask: torch.Tensor | None) -> torch.Tensor | None:
    """An attention mask as it travels: one byte a position, 1 where it attends (any nonzero value), so the receiver
    reads the sender's mask, and its real rows, whatever dtype it was given in."""
    if mask is None or mask.dtype == torch.uint8:
        return mask
    return (mask != 0).to(torch.uint8)


def per_sample(side: torch.Tensor | None, ids: torch.Tensor) -> torch.Tensor | None:
    """An activation's side information as one row per sample (the mask); a length that does not split is an error."""
    if side is None:
        return None
    if ids.numel() == 0 or side.numel() % ids.numel():
        raise TransportError(f"side information of {side.numel()} bytes does not split over {ids.numel()} samples")
    return side.view(ids.numel(), -1)


@dataclass
class StageLinks:
    """A rank's link ends (None where its stage has no such link), and the step's context they share."""

    act_in: ActivationIn | None = None
    act_out: ActivationOut | None = None
    grad_in: GradientIn | None = None
    grad_out: GradientOut | None = None
    tied_rows: RowExchange | None = None  # the first and last stage's end of a tied table's row exchange
    _step: int = 0
    _compress: bool = True
    _next_ids: list[int] | None = None
    _request_with: int | None = None  # the micro-batch whose gradient carries the step's re-seed request

    def begin_step(self, step: int, stream: list[sch.Instruction], compress: bool, next_ids: list[int] | None
                   ) -> None:
        """Post every receive of this stage's `stream` for the step, in the order the stream consumes them, so the
        inbox threads run ahead of compute. Without `compress` (warm-up epochs) every link sends fp32 and AQ-SGD
        refreshes m(ξ); `next_ids`, the next step's samples when it compresses, are what the re-seed request is
        about: it rides on the stream's last gradient sent, which follows every activation this stage receives."""
        self._step, self._compress, self._next_ids = step, compress, next_ids
        self._request_with = None
        for ins in stream:
            if isinstance(ins, sch.RecvActivation) and self.act_in is not None:
                self.act_in.post(step, present(ins.micro_batch, "a receive's micro-batch"))
            elif isinstance(ins, sch.RecvGrad) and self.grad_in is not None:
                self.grad_in.post(step, present(ins.micro_batch, "a receive's micro-batch"))
            elif isinstance(ins, sch.SendGrad):
                self._request_with = ins.micro_batch

    @property
    def keeps_messages(self) -> bool:
        """Whether this rank's outgoing activations go through an m(ξ) store (AQ-SGD)."""
        return self.act_out is not None and self.act_out.codec.keeps_messages

    def send_activation(self, mb: int, activation: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor | None
                        ) -> None:
        """Send micro-batch `mb`'s output to the next stage."""
        present(self.act_out, "the outgoing activation link").send(self._step, mb, activation, ids, mask, self._compress)

    def receive_activation(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The next micro-batch's input from the previous stage: (activation, sample ids, mask)."""
        return present(self.act_in, "the incoming activation link").receive()

    def send_gradient(self, mb: int, grad: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor | None = None
                      ) -> None:
        """Send micro-batch `mb`'s input gradient to the previous stage; the step's last one carries the re-seed
        request."""
        last = mb == self._request_with
        reseed = self.act_in.missing(self._next_ids) if last and self.act_in is not None else None
        present(self.grad_out, "the outgoing gradient link").send(self._step, mb, grad, ids, self._compress, reseed,
                                                                 mask)

    def receive_gradient(self, mask: torch.Tensor | None = None) -> torch.Tensor:
        """The next micro-batch's output gradient from the next stage (applying any re-seed request it carried)."""
        grad, reseed = present(self.grad_in, "the incoming gradient link").receive(mask)
        present(self.act_out, "the outgoing activation link").forget(reseed)
        return grad

    def blocked_seconds(self) -> float:
        """Time this rank's receiving ends have spent so far waiting for messages to arrive."""
        return sum(end.blocked_seconds for end in (self.act_in, self.grad_in) if end is not None)

    def settle(self) -> None:
        """Finish what this rank's receiving codecs left for later (an AQ-SGD receiver's checksum checks): at a step's
        end, so a divergence is refused in the step it happened in."""
        for end in (self.act_in, self.grad_in):
            if end is not None:
                end.codec.settle()

    def settle_after(self, error: BaseException) -> None:
        """After a step failed with `error`: make the checks left for later, so that a divergence they find — perhaps
        the failure's cause — is what the step raises, with `error` as its cause; any other trouble making them
        leaves `error` to be raised."""
        try:
            self.settle()
        except CodecError as divergence:
            raise divergence from error
        except Exception:
            return

    def flush(self) -> None:
        """Wait until everything this rank sent has left."""
        for end in (self.act_out, self.grad_out, self.tied_rows):
            if end is not None:
                end.flush()

    def close(self, abort: bool = False) -> None:
        """Stop the inbox and outbox threads and close the streams; with `abort` (unwinding an error), drop what is
        still queued so the peers see the end of the streams at once, and let no closing error hide the first."""
        for end in (self.act_in, self.grad_in):
            if end is not None:
                end.close()
        for send_end in (self.act_out, self.grad_out, self.tied_rows):
            if send_end is not None:
                try:
                    send_end.close(abort)
                except TransportError:
                    if not abort:
                        raise

    def codecs(self) -> dict[str, LinkCodec]:
        """The training codec of each end this rank has, by slot name (what a checkpoint keeps)."""
        slots: dict[str, SendEnd | RecvEnd | None] = {"fw_send": self.act_out, "fw_recv": self.act_in,
                                                      "bw_send": self.grad_out, "bw_recv": self.grad_in}
        return {slot: end.codec for slot, end in slots.items() if end is not None}

    def take_counters(self) -> dict[str, LinkCounters]:
        """Each end's counters since the last call (then zeroed), by direction and role."""
        taken = {}
        ends: tuple[tuple[str, SendEnd | RecvEnd | None], ...] = (
            ("fwd_sent", self.act_out), ("fwd_received", self.act_in), ("bwd_sent", self.grad_out),
            ("bwd_received", self.grad_in))
        for name, end in ends:
            if end is not None:
                taken[name], end.counters = end.counters, LinkCounters()
            else:
                taken[name] = LinkCounters()
        return taken
