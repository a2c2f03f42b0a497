"""Pure: the matrix into targets, targets into plans (stages, hashes, tags, labels), the Dockerfiles
rendered, the lock file."""
