"""Guided negatives (GIST) and id masks: several column blocks merged into one softmax per row
(``torch_blocks``: PyTorch and the dispatch; ``triton_blocks``: the Triton block Function; ``triton_panel``: the CUDA
route of a summed bf16 loss through the guided epilogue GEMM). Device code: ``kernels/guided.py``."""
