"""A run over many targets: the nightly, rc, bisect, accept and rehearsal lanes, resolve, the summary
table, the disk check before a run."""
