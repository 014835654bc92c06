"""A run's checkpoints: each rank's part on its host's disk (`parts`), what a rank saves and takes back
(`resume`), the parts of one rank as one store with local and remote copies (`store`), the copies sent to other hosts
(`copies`) from a process of the rank's own (`copier`, forked from the rank by `preforked` where it can), where a
start over a run directory begins (`restart`), and the two copies of m(ξ) made equal again after a restart
(`reconcile`)."""
