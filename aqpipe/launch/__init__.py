"""Launching workers: locally, under torchrun or the DeepSpeed launcher."""
