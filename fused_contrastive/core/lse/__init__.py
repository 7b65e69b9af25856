"""The core op (row / column / positive-set log-sum-exp terms over N x M logits): its PyTorch paths
(``torch_dense``: one tile; ``torch_chunked``: O(N*D) memory), its Triton hosts (``triton_function``: the autograd
Function; ``triton_panel``: the panel path; ``library_route``: the route to the ahead-of-time C library) and the
fused kernels' launchers (``triton_fused``). Device code: ``kernels/lse.py``."""
