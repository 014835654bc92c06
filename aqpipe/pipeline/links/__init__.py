"""The links between stages: how the ranks find each other and agree before any collective (`rendezvous`), one TCP
stream per direction of each link (`streams`), framed messages with a validated header (`transport`), a rank's link
ends, each with its codecs, counters and half of the re-seed protocol (`link_ends`), a padded batch's real rows
grouped for the codecs and rebuilt on the other side (`real_rows`), and the first and last stages'
row exchange that keeps a tied input embedding and LM head one tensor (`tied_rows`; its rows as B-bit changes:
`tied_deltas`)."""
