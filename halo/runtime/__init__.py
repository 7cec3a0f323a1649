"""What the tensor-parallel and pipeline runtimes share: local agent processes, measuring a device, re-planning a
running cluster."""
