"""The arithmetic of a stage's step: the optimizer, its warm-up and decay, clipping on the whole model's gradient
norm (`optim`); the compute dtype and fp16 loss scaling agreed across the pipeline (`mixed_precision`); parameters
that have a copy on several layers or stages, whose gradients are summed over every copy (`tied`)."""
