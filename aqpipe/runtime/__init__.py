"""One rank's run: planning and the capacity plan, assembling its stage, the step loop, checkpoints (`checkpoints/`),
replica checks, and what a run leaves: each step's metrics record, progress lines, the final weights, the exports, the
run directory's files and summary."""
