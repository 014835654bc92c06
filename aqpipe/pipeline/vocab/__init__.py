"""The engine's vocabularies, each one table that the configuration, the runtime and the engine's rooms read, none
importing torch (the command validates a choice before torch loads): the schedules as pure instruction streams
(`schedule`), a step's statistics and how the ranks' values combine (`step_stats`), and the `--precision`,
`--tied-exchange` and `--link-rows` choices (`precisions`, `tied_exchanges`, `link_rows`)."""
