"""Package discovery (the rest of the metadata is in pyproject.toml).

Every package under ``fused_contrastive/`` is found, not listed, so a new sub-package cannot be left
out of the wheel; ``kernels/`` (Triton device code only) ships as ``fused_contrastive.kernels``
through ``package-dir`` in pyproject.toml, with its own sub-packages if it ever has any.
"""

from setuptools import find_packages, setup

setup(packages=[*find_packages(include=["fused_contrastive", "fused_contrastive.*"]),
                "fused_contrastive.kernels",
                *(f"fused_contrastive.kernels.{p}" for p in find_packages(where="kernels"))])
