"""One rank's run. `plan` decides everything before training (data, model, stage boundaries, steps); `capacity/`
works out what the run will hold and send; `rank/` assembles the stage and trains; `checkpoints/` saves, copies,
reconciles and resumes; `outputs/` records and writes what the run leaves; `events` is the worker's side of the
launcher's event protocol."""
