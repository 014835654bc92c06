"""What a run leaves and says: each step's metrics record, progress and evaluation lines, the final weights gathered
on rank 0, the exports, and the run directory's config.json, metrics log, summary and plot."""
