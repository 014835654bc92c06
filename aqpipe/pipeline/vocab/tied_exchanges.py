"""The `--tied-exchange` vocabulary (no torch import, so the configuration can check a name cheaply): how a tied input
embedding and LM head on different stages stay one tensor (`aqpipe.pipeline.links.tied_rows`, `aqpipe.pipeline.numerics.tied`)."""

from dataclasses import dataclass

# the exact row exchanges, by the dtype their rows and gradient rows travel in (fp32: the dense all-reduce's run, bit
# for bit; bf16: half the bytes, the embedding computing on bf16-rounded rows and the head adding bf16-rounded
# gradients)
EXACT_ROWS = {"rows": "float32", "rows:bf16": "bfloat16"}
# the delta-coded row exchanges, by their bits (`aqpipe.pipeline.links.tied_deltas`): rows as B-bit changes against the copy
# both ends hold, gradient rows B-bit with error feedback
DELTA_ROWS = {f"rows:delta:{bits}": bits for bits in range(2, 9)}
ROW_EXCHANGES = (*EXACT_ROWS, *DELTA_ROWS)
TIED_EXCHANGES = (*ROW_EXCHANGES, "dense")
USAGE = "rows, rows:bf16, rows:delta:B (B = 2..8 bits), dense"
# The exchange when --tied-exchange is not given and the links compress: chosen by the SmolLM2 fine-tuning benchmark
# (benchmarks/README.md, "Every byte of a fine-tune"): 7.3x fewer tied bytes than exact rows over a 2-epoch run,
# whose held-out loss ended 0.57% below fp32 links'. With lossless links (--fw fp32 --bw fp32) the default is `rows`,
# which keeps such a run the dense all-reduce's, bit for bit.
DEFAULT_TIED_EXCHANGE = "rows:delta:4"


@dataclass(frozen=True)
class TiedExchange:
    """A `--tied-exchange` value, parsed: whether the tied table is kept equal by exchanging rows, the dtype exact
    rows travel in (delta-coded exchanges send a row exactly in fp32), and the bits of a delta-coded exchange's
    changes and gradient rows (0: exact rows)."""

    name: str
    by_rows: bool
    wire_dtype: str
    delta_bits: int


def parse_exchange(name: str) -> TiedExchange:
    """The parsed `--tied-exchange` value; ValueError naming the choices for one that is not."""
    if name not in TIED_EXCHANGES:
        raise ValueError(f"--tied-exchange {name!r} is not one of {USAGE}")
    return TiedExchange(name, name in ROW_EXCHANGES, EXACT_ROWS.get(name, "float32"), DELTA_ROWS.get(name, 0))


def default_exchange(fw: str, bw: str) -> str:
    """--tied-exchange when not given: exact rows beside lossless links, else DEFAULT_TIED_EXCHANGE."""
    return "rows" if fw == bw == "fp32" else DEFAULT_TIED_EXCHANGE
