"""Make the bases, build the stage images with BuildKit (with a cache across runners), the preflight
before the compile, the runtime's dependency closure, the binary check."""
