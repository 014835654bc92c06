"""Whether a codec benchmark's figures are its GPU path's or a fallback's: the CUDA graphs this process holds, why new
ones stopped being captured, why the fused kernels are off — read beside each row (`codec_speed.py`,
`codec_profile.py`) and marked where either fell back (`codec_ab.py` too). No torch at import: `codec_ab.py`, which
only starts the measuring processes, prints the marks."""

from __future__ import annotations

UNKNOWN = "not reported"  # (by an aqpipe from before these reports: a baseline tree of `codec_ab.py`)


def codec_path() -> dict:
    """How the codecs' GPU path stands in this process so far: the CUDA graphs held, why new ones stopped being
    captured and why the fused kernels are off (None: they were not). A figure timed after either fell back is the
    fallback's: one H100 run (89a45ef) read AQ-SGD at 54 / 61 GB/s a side at 8 × 1024 × 576, then 8–9 / 12–16 in
    the slab rows after a failed capture."""
    from aqpipe.compress.gpu import cuda_graphs, fused

    return {"graphs_held": cuda_graphs.captured(),
            "graphs_stopped": cuda_graphs.stopped() if hasattr(cuda_graphs, "stopped") else UNKNOWN,
            "fused_off": fused.failure() if hasattr(fused, "failure") else UNKNOWN}


def fallback_note(path: dict) -> str:
    """A row's mark where the codecs' GPU path had fallen back (`codec_path`), else nothing."""
    stopped, fused_off = (None if why == UNKNOWN else why for why in (path["graphs_stopped"], path["fused_off"]))
    reasons = [why for why in (stopped, fused_off and f"fused kernels off: {fused_off}") if why]
    return f"  [FELL BACK: {'; '.join(reasons)}]" if reasons else ""
