"""The check models sparkbuild makes offline: the dense alphabet model, the quantized MoE models."""
