"""The link codecs: what crosses a stage boundary (activations forward, their gradients backward), by name in one
table (`specs`), built by `codecs.build_codec`; one module per codec family (AQ-SGD, direct quantization, top-k)."""
