"""What the codec tests share: a message's header, a send through a link, and a pair of AQ-SGD ends."""

import threading

import torch

from aqpipe.compress.link.factory import build_codec
from aqpipe.compress.link.options import QuantOptions
from aqpipe.pipeline.links.transport import KIND_ACTIVATION, Header
from aqpipe.storage import MemoryStore, StoreView


def wire(codec, encoded, ids, step=0, mb=0):
    """The header a sender would put in front of `encoded`."""
    return Header(KIND_ACTIVATION, step, mb, encoded.shape, encoded.wire_dtype, ids.numel(), encoded.payload.numel(),
                  codec=codec.code, codec_check=encoded.codec_check, flags=encoded.flags)


def send(sender, receiver, x, ids, compress=True):
    encoded = sender.encode(x, ids, compress)
    header = wire(sender, encoded, ids)
    assert receiver.check_header(header) is None
    return encoded, receiver.decode(header, encoded.payload.clone(), ids)


def aqsgd_pair(bits, dtype=torch.float16, kind="aqsgd", first_sight="fp32", **options):
    sender_store, receiver_store = MemoryStore(dtype), MemoryStore(dtype)
    opts = QuantOptions(**options)
    return (build_codec(f"{kind}:{bits}", "fw", StoreView(sender_store, 0, "send"), opts, first_sight=first_sight),
            build_codec(f"{kind}:{bits}", "fw", StoreView(receiver_store, 0, "recv"), opts, first_sight=first_sight),
            sender_store, receiver_store)


def device_reads(monkeypatch) -> list[tuple[str, int]]:
    """Every read of tensor values into Python (what makes a host wait for a GPU), as (how, elements)."""
    seen: list[tuple[str, int]] = []
    for how in ("tolist", "item", "__bool__", "__float__", "__int__", "nonzero"):
        real = getattr(torch.Tensor, how)

        def spy(self, *args, _real=real, _how=how, **kwargs):
            if threading.current_thread() is threading.main_thread():  # (another test's lingering thread is not ours)
                seen.append((_how, self.numel()))
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, how, spy)
    return seen


def device_moves(monkeypatch, reads: list, module) -> list[int]:
    """Each time a codec hands values to the device (`to_device`, from the codec base class's module or `module`'s
    own import), how many reads `device_reads` had seen by then."""
    from aqpipe.compress.gpu import copies
    from aqpipe.compress.link import base

    moved: list[int] = []
    real = copies.to_device

    def spy(values, device):
        moved.append(len(reads))
        return real(values, device)

    for where in (base, module):
        monkeypatch.setattr(where, "to_device", spy, raising=False)
    return moved
