"""SigLIP's sigmoid loss (``torch_siglip``: PyTorch; ``triton_siglip``: the Triton launchers and autograd
Function; ``triton_sweep``: its panel sweep through the epilogue GEMM; ``triton_fp16pass``: the sweep's fp16 pass
option). Device code: ``kernels/siglip.py`` (and ``kernels/logit_pass.py``'s ``siglip_pass_kernel``)."""
