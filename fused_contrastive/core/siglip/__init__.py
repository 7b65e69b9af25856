"""SigLIP's sigmoid loss (``torch_siglip``: PyTorch; ``triton_siglip``: the Triton launchers and autograd
Function; ``triton_sweep``: its panel sweep through the epilogue GEMM). Device code: ``kernels/siglip.py``."""
