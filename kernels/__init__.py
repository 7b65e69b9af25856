"""Triton device code of fused-contrastive (shipped as ``fused_contrastive.kernels``).

Only ``@triton.jit`` functions live here; launchers, autograd Functions and dispatch are in the
``fused_contrastive`` package. Nothing here touches a GPU driver at import time.
"""
