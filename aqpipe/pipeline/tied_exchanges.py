"""The `--tied-exchange` vocabulary (no torch import, so the configuration can check a name cheaply): how a tied input
embedding and LM head on different stages stay one tensor (`aqpipe.pipeline.tied_rows`, `aqpipe.pipeline.tied`)."""

# the row exchanges, by the dtype their rows and gradient rows travel in (fp32: the dense all-reduce's run, bit for
# bit; bf16: half the bytes, the embedding computing on bf16-rounded rows and the head adding bf16-rounded gradients)
ROW_EXCHANGES = {"rows": "float32", "rows:bf16": "bfloat16"}
TIED_EXCHANGES = (*ROW_EXCHANGES, "dense")
