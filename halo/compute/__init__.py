"""What a device computes: weight formats and kernels (linear), neuron groups and their partial outputs, a device's
share of the model (worker), HALO's re-mapped groups, batched rows, and the single-process reference model."""
