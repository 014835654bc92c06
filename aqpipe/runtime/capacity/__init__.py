"""The capacity plan (`--dry-run`, `aqpipe bench`, the refusal of a run that cannot fit), worked out in
`plan`: what each stage holds, traced from its real forward (`stage_trace`), and the codecs' CUDA graphs beside it
(`codec_graphs`); what each link sends per step (`links`), only the real rows of padded batches where they travel so
(`rows`), and its held-out passes (`eval_passes`); the least step time the wire allows (`step_wire`); the table
`--dry-run` prints (`table`)."""
