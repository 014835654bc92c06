"""A tied input embedding and LM head on different stages, kept one tensor by exchanging rows, not the table.

SmolLM2, Qwen2.5-0.5B and Llama 3.2 use one matrix as the input embedding (first stage) and as the LM head (last
stage). Megatron and DeepSpeed's pipeline engine keep the two copies equal by all-reducing the whole table's
gradient between them every step: 113 MB for SmolLM2, about 1 GB for Llama 3.2 1B, far more than the compressed
activations the links carry. The step needs much less:

- the head (the *owner*) uses every row, so it holds the table and its optimizer state and takes every update;
- the embedding (the *lookup* side) reads only the rows of the tokens its micro-batches hold, and its gradient is
  non-zero only there.

So at the start of a step the owner sends the current values of those rows (it holds the same samples: its targets
are the tokens), the lookup side writes them into its copy, and as the backward goes the lookup side sends its
gradient's rows, which the owner adds to the head's gradient before clipping, the grad sync and the optimizer.
The owner's gradient is then exactly the sum the dense all-reduce forms (one addition per element; adding the other
stages' zeros changes nothing), and the lookup side computes on exactly the owner's rows: with fp32 links the run is
the dense exchange's, bit for bit. Bytes per step scale with the distinct tokens of the step, not the vocabulary,
and only the two stages holding copies send any.

Both directions stream, so that the exchange hides behind the pipeline rather than delaying it (at 1 Mbit/s a step's
rows of a 49,152-token vocabulary take seconds): the owner sends the rows in the order of the micro-batches that
first use them, one message per micro-batch, and the lookup side waits, before each forward, only for the rows of
that micro-batch; after each backward the lookup side sends the gradient rows no later micro-batch touches (a row's
gradient is then final: later backwards add exact zeros to it), one message per backward. The values are the same
as sent whole, so streaming changes no bit of the run.

The lookup side's table is therefore a cache: rows it has not looked up lately are stale, its optimizer does not
hold it, its resumable checkpoints carry it only as the rows it last read (a resumed step fetches its rows first),
and the replica digest leaves it out. At the end, rank 0 (replica 0's first stage) receives every stage's final
weights for the export anyway, and takes the whole table from the head's before it writes its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from aqpipe.compress.gpu.copies import to_device
from aqpipe.pipeline.links.tied_deltas import RowDeltas, table_digest
from aqpipe.pipeline.links.transport import (
    HEADER_SIZE,
    KIND_TIED_GRADS,
    KIND_TIED_ROWS,
    Expect,
    Header,
    Inbox,
    Outbox,
    TransportError,
)
from aqpipe.pipeline.numerics.tied import local_copies

# The micro-batch field of an evaluation pass's rows message (one message, every row); a training step's messages
# carry the index of the micro-batch (rows) or of the backward (gradient rows) they belong to.
EVALUATION_PART = -1
HANDSHAKE_PART = -2  # the lookup side's digest of its cache, before delta-coded rows first travel (`tied_deltas`)
FOR_TRAINING, FOR_EVALUATION = "training", "evaluation"

OWNER, LOOKUP = "owner", "lookup"


def step_rows(tokens: list[torch.Tensor]) -> torch.Tensor:
    """The distinct token ids of a step's (or evaluation pass's) micro-batches, ascending (int64, on the host)."""
    if not tokens:
        return torch.zeros(0, dtype=torch.int64)
    return torch.unique(torch.cat([t.reshape(-1).to("cpu", torch.int64) for t in tokens]), sorted=True)


@dataclass(frozen=True)
class StepParts:
    """How one step's rows travel: `rows` (the step's distinct tokens, ascending), `values[k]` the rows micro-batch k
    is the first to use (sent before its forward), `grads[i]` the rows whose gradient is final after the i-th
    backward of the lookup side (no later backward touches them)."""

    rows: torch.Tensor
    values: list[torch.Tensor]
    grads: list[torch.Tensor]


def step_parts(tokens: list[torch.Tensor], backward_order: list[int]) -> StepParts:
    """Split a step's rows by the micro-batch that first uses them and by the backward after which their gradient is
    final (`backward_order`: the lookup side's micro-batches in the order it runs their backwards)."""
    rows = step_rows(tokens)
    n = len(tokens)
    if sorted(backward_order) != list(range(n)):
        raise ValueError(f"a backward order names each of the {n} micro-batches once, got {backward_order}")
    first = torch.full((len(rows),), n, dtype=torch.int64)
    last = torch.full((len(rows),), -1, dtype=torch.int64)
    for position, index in enumerate(backward_order):
        used = torch.searchsorted(rows, step_rows([tokens[index]]))
        first[used] = torch.minimum(first[used], torch.tensor(index))
        last[used] = position
    return StepParts(rows, [rows[first == k] for k in range(n)], [rows[last == i] for i in range(n)])


def table_parameter(module: nn.Module, group: str) -> tuple[str, nn.Parameter]:
    """The one copy of tied group `group` a first or last stage holds, with its parameter name in `module`."""
    copies = local_copies(module).get(group, [])
    if len(copies) != 1 or len(copies[0]) != 1:
        raise ValueError(f"a stage exchanging tied table {group} by rows holds exactly one copy of it, "
                         f"this one holds {len(copies)}")
    table = copies[0][0]
    name = next(n for n, p in module.named_parameters() if p is table)
    return name, table


@dataclass
class RowExchange:
    """One end of a replica's row exchange of one tied table: `owner` (the last stage's LM head) sends rows and
    receives gradient rows, `lookup` (the first stage's embedding) the other way round. Both ends are called with
    the same token batches at the same points of a step: `begin`, then on the lookup side `ready` before each
    forward and `backward_done` after each backward, then `exchange_gradients` on both."""

    role: str
    name: str  # the table's parameter name in its stage module (state dict key)
    table: nn.Parameter
    outbox: Outbox
    inbox: Inbox
    wire_dtype: torch.dtype = torch.float32  # what rows and gradient rows travel in (--tied-exchange rows:bf16)
    deltas: RowDeltas | None = None  # rows as B-bit changes, gradient rows B-bit with error feedback (rows:delta:B)
    bytes_sent: int = 0
    _compared: bool = False  # delta-coded rows: the two ends have compared their copies of the table
    _parts: StepParts | None = None  # the current step's
    _received: int = 0  # lookup side: micro-batches whose rows have arrived this step
    _backwards: int = 0  # lookup side: backwards run this step
    _before_evaluation: tuple[torch.Tensor, torch.Tensor] | None = None  # lookup, delta-coded: the cache's rows an
    # evaluation overwrote (put back by `end_evaluation`, so that evaluating changes nothing in training)

    def __post_init__(self) -> None:
        if self.role not in (OWNER, LOOKUP):
            raise ValueError(f"a row exchange end is {OWNER!r} or {LOOKUP!r}, not {self.role!r}")

    def begin(self, step: int, tokens: list[torch.Tensor], purpose: str = FOR_TRAINING,
              backward_order: list[int] | None = None) -> None:
        """Start a step (`backward_order`: the lookup side's, default ascending) or an evaluation pass over `tokens`,
        one tensor per micro-batch. The owner sends the rows and returns at once. For a step, the lookup side only
        announces what it expects (`ready` waits); for an evaluation it waits for every row and writes them."""
        self._compare(step)
        if purpose == FOR_EVALUATION:  # (delta-coded: coded against the mirror, which does not take them)
            rows = step_rows(tokens)
            if self.role == OWNER:
                self._send(KIND_TIED_ROWS, step, EVALUATION_PART, rows, self._current(rows, keep=False))
                return
            self._expect(KIND_TIED_ROWS, step, EVALUATION_PART, rows)
            if self.deltas is not None:
                self._before_evaluation = rows, self.table.detach()[to_device(rows, self.table.device)].clone()
            self._write(rows, self._receive(rows))
            return
        parts = self._parts = step_parts(tokens, list(range(len(tokens))) if backward_order is None else backward_order)
        self._received = self._backwards = 0
        if self.deltas is not None:
            self.deltas.begin_step()
        if self.role == OWNER:
            for index, rows in enumerate(parts.values):
                self._send(KIND_TIED_ROWS, step, index, rows, self._current(rows))
            for position, rows in enumerate(parts.grads):
                self._expect(KIND_TIED_GRADS, step, position, rows)
            return
        for index, rows in enumerate(parts.values):
            self._expect(KIND_TIED_ROWS, step, index, rows)

    def ready(self, index: int) -> None:
        """Lookup side, before the forward of micro-batch `index`: wait until the rows it uses are current."""
        parts = self._step_parts()
        while self._received <= index:
            rows = parts.values[self._received]
            self._write(rows, self._receive(rows))
            self._received += 1

    def end_evaluation(self) -> None:
        """Lookup side, after an evaluation pass: a delta-coded cache takes back the rows the pass overwrote (the
        mirror never took them)."""
        if self._before_evaluation is not None:
            rows, values = self._before_evaluation
            self._before_evaluation = None
            with torch.no_grad():
                self.table.index_copy_(0, to_device(rows, self.table.device), values)

    def backward_done(self, step: int, loss_scale: float = 1.0) -> None:
        """Lookup side, after each backward: send the gradient rows no later backward of the step touches (with the
        loss scale `loss_scale` still in them, which the owner takes out; delta-coded rows go unscaled, as their
        errors are kept)."""
        parts = self._step_parts()
        rows = parts.grads[self._backwards]
        grad = self.table.grad
        values = torch.zeros(len(rows), self.table.shape[1], dtype=self.table.dtype) if grad is None \
            else grad.detach()[to_device(rows, grad.device)]
        if self.deltas is not None:
            values = self.deltas.encode_grads(rows, values / loss_scale, self.table.shape[0])
        self._send(KIND_TIED_GRADS, step, self._backwards, rows, values)
        self._backwards += 1

    def exchange_gradients(self, unscale: float = 1.0, drop: bool = False) -> None:
        """After the step's backwards: the lookup side lets go of its gradient (its optimizer does not hold the
        table); the owner receives every gradient row, multiplies them by `unscale` (the loss scale's inverse, as
        the lookup side's own gradients are unscaled) and adds them to the head's gradient, or with `drop` (an
        overflowed step) receives and discards them."""
        parts = self._step_parts()
        if self.role == LOOKUP:
            if drop and self.deltas is not None:  # (the step is skipped: its gradients' errors are not kept)
                self.deltas.undo_step()
            if self._backwards != len(parts.grads):
                raise RuntimeError(f"the step ran {self._backwards} backwards of {len(parts.grads)} on the tied table "
                                   f"{self.name}'s lookup side")
            self.table.grad = None
            return
        received = [self._receive(rows) for rows in parts.grads]
        if self.deltas is not None:  # (sent unscaled)
            received = [self.deltas.decode_grads(rows, payload) for rows, payload in zip(parts.grads, received)]
            unscale = 1.0
        if drop:
            return
        if self.table.grad is None:
            self.table.grad = torch.zeros_like(self.table)
        for rows, values in zip(parts.grads, received):
            values = to_device(values, self.table.device).to(self.table.grad.dtype)
            if unscale != 1.0:
                values = values.mul_(unscale)
            self.table.grad.index_add_(0, to_device(rows, self.table.device), values)

    def sq_norm(self) -> torch.Tensor:
        """The table's share of the whole model's squared gradient norm (float64): all of it on the owner, whose
        gradient is the whole one after `exchange_gradients`, none on the lookup side."""
        grad = self.table.grad
        if self.role == LOOKUP or grad is None:
            return torch.zeros((), dtype=torch.float64)
        return grad.detach().double().pow(2).sum()  # on the device: read once, with the rest of the norm

    def flush(self) -> None:
        """Wait until everything this end sent has left (raising why it could not)."""
        self.outbox.flush()

    def close(self, abort: bool = False) -> None:
        """Stop receiving, then send what is queued and close (with `abort`, close at once)."""
        self.inbox.close()
        self.outbox.close(abort)

    def _step_parts(self) -> StepParts:
        if self._parts is None:
            raise RuntimeError("the tied rows of a step used before begin: the step's rows are not known")
        return self._parts

    def _compare(self, step: int) -> None:
        """Before delta-coded rows first travel in this process: the lookup side sends the digest of its cache, the
        owner compares it with its mirror's and vouches for the rows (all or none)."""
        if self.deltas is None or self._compared:
            return
        self._compared = True
        nothing = torch.zeros(0, dtype=torch.int64)
        if self.role == LOOKUP:
            self._send(KIND_TIED_GRADS, step, HANDSHAKE_PART, nothing, table_digest(self.table))
            return
        self._expect(KIND_TIED_GRADS, step, HANDSHAKE_PART, nothing)
        self.deltas.start_owner(self.table, self._receive(nothing))

    def state_dict(self) -> dict:
        """What a checkpoint keeps of this end (the delta coding's mirror or errors; nothing for exact rows)."""
        return {} if self.deltas is None else self.deltas.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict`'s output; the two ends compare their copies again before rows next travel."""
        if self.deltas is not None:
            self.deltas.load_state_dict(state, self.table.device)
            self._compared = False

    def _current(self, rows: torch.Tensor, keep: bool = True) -> torch.Tensor:
        """The payload of `rows`' current values (delta-coded: the mirror takes them unless not `keep`)."""
        values = self.table.detach()[to_device(rows, self.table.device)]
        return values if self.deltas is None else self.deltas.encode_rows(rows, values, keep)

    def _write(self, rows: torch.Tensor, values: torch.Tensor) -> None:
        if self.deltas is not None:
            values = self.deltas.decode_rows(rows, values, self.table)
        with torch.no_grad():
            self.table.index_copy_(0, to_device(rows, self.table.device),
                                   to_device(values, self.table.device).to(self.table.dtype))

    def _send(self, kind: int, step: int, part: int, rows: torch.Tensor, values: torch.Tensor) -> None:
        if values.dtype != torch.uint8:  # (coded payloads and digests go as they are)
            values = values.to(self.wire_dtype)
        values = values.contiguous()  # (a GPU's rows reach the host in the outbox's own time)
        header = Header(kind, step, part, tuple(values.shape), values.dtype, len(rows), 0)
        self.outbox.send(header, rows, values)
        self.bytes_sent += HEADER_SIZE + values.numel() * values.element_size() + 8 * len(rows)

    def _expect(self, kind: int, step: int, part: int, rows: torch.Tensor) -> None:
        self.inbox.expect(Expect(kind, step, part, len(rows)))

    def _receive(self, rows: torch.Tensor) -> torch.Tensor:
        """The next announced message's values, which must be for exactly `rows`."""
        message = self.inbox.get()
        if not torch.equal(message.ids, rows):
            raise TransportError(f"{self.inbox.peer_name} sent the rows of other tokens for tied table {self.name} "
                                 f"at step {message.header.step + 1} (the two stages disagree on the step's samples)")
        if self.deltas is not None:  # (coded rows, gradient rows and the digest: flat bytes)
            if message.header.dtype != torch.uint8 or len(message.header.shape) != 1:
                raise TransportError(f"{self.inbox.peer_name} sent rows of shape {message.header.shape} "
                                     f"{message.header.dtype} for tied table {self.name}, expected coded bytes")
            return message.payload
        width = self.table.shape[1]
        if message.header.shape != (len(rows), width) or message.header.dtype != self.wire_dtype \
                or message.payload.numel() != len(rows) * width * self.wire_dtype.itemsize:
            raise TransportError(f"{self.inbox.peer_name} sent rows of shape {message.header.shape} "
                                 f"{message.header.dtype} for tied table {self.name}, expected "
                                 f"{(len(rows), width)} {self.wire_dtype}")
        return message.payload.view(self.wire_dtype).view(len(rows), width).to(self.table.dtype)
