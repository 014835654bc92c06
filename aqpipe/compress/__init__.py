"""Compression. At the top, the quantizer primitives: b-bit quantization with per-sample scales on a named grid
(`quantize`, `grids`), rotated tile quantization (`rotated`), bit packing (`bitpack`). `link/`: the link codecs,
what crosses a stage boundary; `grad/`: the data-parallel gradient compressors; `gpu/`: the GPU machinery the codecs
run on (copies between host and device that do not wait, CUDA graphs and the memory they hold, fused Triton
kernels)."""
