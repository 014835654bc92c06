"""Compression: link codecs for activations and gradients, and data-parallel gradient compressors."""
