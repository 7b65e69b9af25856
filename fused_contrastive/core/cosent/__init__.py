"""CoSENT (``torch_cosent``: PyTorch; ``triton_cosent``: the Triton launchers and autograd Functions). Device
code: ``kernels/cosent.py``."""
