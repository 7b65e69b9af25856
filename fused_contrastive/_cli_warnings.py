"""The command line's warning filter, installed before torch is imported (the package imports this module
first): ``python -m fused_contrastive`` and the ``fused-contrastive`` script. Without NumPy (an install without
an extra) torch warns at import that it cannot initialise NumPy, which no command needs; only that message is
silenced, and only in the command's process (importing the library keeps it)."""

import sys
import warnings


def is_cli(orig_argv: list[str], argv0: str) -> bool:
    """Whether this process is the command line: ``-m fused_contrastive[.sub]`` or the console script."""
    via_m = any(a == "-m" and b.split(".")[0] == "fused_contrastive" for a, b in zip(orig_argv, orig_argv[1:],
                                                                                      strict=False))
    return via_m or argv0.endswith(("fused-contrastive", "fused-contrastive.exe"))


if is_cli(sys.orig_argv, sys.argv[0]):
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)
