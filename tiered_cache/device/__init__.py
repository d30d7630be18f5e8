"""The paged KV pool on one device, its page movements (torch or CuPy kernels), and transfers
between the pool and pinned host memory on copy streams."""
