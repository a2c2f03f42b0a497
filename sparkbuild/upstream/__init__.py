"""Upstream's sources (git, PyPI sdists) and what sparkbuild knows of them: vLLM's external projects,
the kernel-path log formats."""
