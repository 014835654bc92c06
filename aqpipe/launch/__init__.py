"""Launching a job: `job` validates it and either becomes a rank (under torchrun or the DeepSpeed launcher, whose
environment `env` reads) or starts them all on this machine (`local`: logs, progress, teardown on failure), each rank
forked from a warm server (`rank_server`, driven by the launcher's `forkserver`, when `fork_safety` allows) or started
as `worker_entry`; the run directory's lock (`rundir`), interrupts (`signals`), throttled namespaces behind `tc tbf`
(`netns`), and ranks sharing a GPU (`gpu_sharing`)."""
