"""One rank's run: planning and the capacity plan, assembling its stage, the step loop, checkpoints (`checkpoints/`),
replica checks and the run's outputs."""
