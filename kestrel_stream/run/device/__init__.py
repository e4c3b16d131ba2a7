"""The device backend: context, kernels, arena and state (backend.py), launches from the step program's
ops (ops.py, launches.py), whole steps as graphs per batch bucket (whole_step.py), greedy and sampled
chains and the device sampler, the paged KV pool, the residency window's mechanism and the memory budget."""
