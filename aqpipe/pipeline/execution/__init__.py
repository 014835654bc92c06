"""One stage's work, step by step: the stage worker that interprets its instruction stream (`worker`), the end of
its step from gradients to new weights (`optimizer_phase`), the forward-only pass over the held-out split
(`evaluate`), and what a step measures of itself: the activation bytes held for backward (`held`), forward and
backward times on a GPU (`gpu_timing`), the calls that make the host wait for the GPU (`sync_audit`)."""
