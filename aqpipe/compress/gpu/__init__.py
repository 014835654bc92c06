"""The GPU machinery the codecs run on: copies between the host and a device that make neither side wait
(`copies`); CUDA graphs that replay a message's kernels as one launch (`cuda_graphs`), and what they hold, worked out
on the meta device for the capacity plan (`graph_memory`); fused Triton kernels for DirectQ's and AQ-SGD's rows
(`fused`; their source, imported only where Triton is: `fused_kernels`)."""
