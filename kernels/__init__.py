"""Triton kernels of fasttrain, shipped in the wheel as ``fasttrain.kernels``.

Each module holds the ``@triton.jit`` kernels and a plain launcher (checks, allocation, grid);
the autograd functions and public APIs live in ``fasttrain.optim`` and ``fasttrain.loss``.
Importing this package does not import triton: the modules do, on first use.
"""
