"""The shared ground: running commands, logging, files, signals, bounded YAML, value checks, the run
lock, addresses, this host."""
