"""The paged KV pool on one device, its page movements (torch or CuPy kernels), and transfers
between the pool and pinned host memory on copy streams; how large host buffers are allocated
(memory.py: pre-touched off the request path; malloc.py: glibc settings, torch-free)."""
