"""A run's checkpoints: parts on disk, copies on other hosts, where a start begins, resume and reconciliation."""
