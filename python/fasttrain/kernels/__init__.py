"""fasttrain's Triton kernels: each module holds the ``@triton.jit`` kernels and a plain launcher (checks,
allocation, grid). The autograd functions and public APIs live in ``fasttrain.optim`` and ``fasttrain.loss``.

The modules import nothing else of fasttrain's, so each also loads on its own (tests/_compile_kernels_sm90.py
compiles every entry point for sm_90 from them).
"""
