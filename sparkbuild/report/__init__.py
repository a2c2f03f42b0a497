"""``sparkbuild report``: a repository's nights, read from its registry, as a static site."""
