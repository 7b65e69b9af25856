"""Peer code the tests compare against, loaded the way this machine can load it."""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path
from types import ModuleType


@functools.cache
def open_clip_loss() -> ModuleType | None:
    """open_clip's ``loss.py`` (ClipLoss, SigLipLoss), loaded by file path from the installed package, or
    None when open_clip is not installed. ``import open_clip`` imports torchvision (whose only build for
    this torch cannot load here); ``loss.py`` imports only torch, and ``find_spec`` does not run the
    package's ``__init__``."""
    spec = importlib.util.find_spec("open_clip")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "loss.py"
    mod_spec = importlib.util.spec_from_file_location("open_clip_loss_by_path", path)
    mod = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(mod)
    return mod
