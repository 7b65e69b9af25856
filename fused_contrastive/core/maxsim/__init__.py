"""MaxSim (late interaction) launchers (``triton_maxsim``); the public API and the PyTorch path are
``fused_contrastive/maxsim.py``. Device code: ``kernels/maxsim.py``."""
