"""Matryoshka: the core op at K prefix levels of D in one pass (``torch_levels``: PyTorch; ``triton_levels``:
the Triton launchers and autograd Function). Device code: ``kernels/matryoshka.py``."""
