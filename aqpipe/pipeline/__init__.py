"""The pipeline engine: schedules as instruction streams, the stage worker that interprets them, the links between
stages (framed streams, codecs at both ends), the rank grid, and the numerics of a stage's step (mixed precision,
optimizer, tied parameters, evaluation). Knows nothing of configuration files or launching."""
