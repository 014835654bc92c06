"""What the codecs' CUDA graphs hold on a stage's GPU, for the capacity plan.

A rank of stage s runs four link ends at most: it sends activations down link s and receives their gradients back,
and receives activations from link s − 1 and sends their gradients up. On a GPU each end's codec replays CUDA
graphs (`aqpipe.compress.gpu.cuda_graphs`), and each graph keeps its inputs' copies and its memory pool for the run —
for AQ-SGD at a micro-batch of 8 × 1024 × 576 a few hundred MB a rank, the same order as a stage's weights. Each
end's graphs are measured on the meta device (`aqpipe.compress.gpu.graph_memory`) at its link's micro-batch shape.
"""

from __future__ import annotations

from aqpipe.compress.gpu import cuda_graphs
from aqpipe.compress.gpu.graph_memory import graphs_bytes
from aqpipe.compress.link.factory import build_codec
from aqpipe.compress.link.options import QuantOptions
from aqpipe.config import ResolvedConfig
from aqpipe.storage import MemoryStore, SlabStore, StoreView
from aqpipe.storage.encoding import value_dtype


def stage_graph_bytes(cfg: ResolvedConfig, stage: int, link_shapes: list[tuple[int, ...]]) -> int:
    """Device bytes one rank of `stage` holds in its codecs' CUDA graphs (`link_shapes[k]`: link k's micro-batch
    activation shape): 0 where codecs replay no graphs (a CPU run, `AQPIPE_CUDA_GRAPHS=0`)."""
    if cfg.device != "cuda" or not cuda_graphs.enabled():
        return 0
    ends = []  # (link, spec, direction, sending)
    if stage < len(link_shapes):
        ends += [(stage, cfg.fw_spec, "fw", True), (stage, cfg.bw_spec, "bw", False)]
    if stage > 0:
        ends += [(stage - 1, cfg.fw_spec, "fw", False), (stage - 1, cfg.bw_spec, "bw", True)]
    options = QuantOptions.of(cfg)
    calls = []
    for link, spec, direction, sending in ends:
        view = None
        if spec.keeps_messages:
            dtype = value_dtype(cfg.store_dtype)  # (kept as a GPU's slabs, a codec's fused step replays a graph)
            store = SlabStore(dtype, "meta") if cfg.store_device == "cuda" else MemoryStore(dtype)
            view = StoreView(store, link, "send" if sending else "recv")
        codec = build_codec(spec, direction, view, options, first_sight=cfg.first_sight_spec)
        calls += codec.graph_calls(link_shapes[link], sending, warmup=cfg.warmup_epochs > 0)
    return graphs_bytes(calls)  # (a graph two ends share counted once)
