"""sparkbuild: patched, tested, published vLLM images for the NVIDIA DGX Spark."""

__version__ = "0.1.0"
