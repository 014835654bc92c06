"""The pipeline runtime: rank grid, schedules, framed transport, stage worker, training loop."""
