"""Run the ahead-of-time library's launches under the Triton interpreter, so its results have values on a
machine without a GPU (tests/test_cmake_build.py).

The mock driver (csrc/mock_cuda.c) hands every launch to a hook (``fc_mock_set_exec``): the module image,
the kernel's name, the grid and the parameter bytes in the cubin's own layout. :func:`install` sets a hook
that finds the generated variant of the image (by its sha256 in the generator's manifest), decodes the
parameters by the kernel's generated layout (pointer arguments typed by the variant's signature), and
calls the same ``@triton.jit`` function of ``kernels/`` with the variant's constexprs on that grid under
the interpreter (``TRITON_INTERPRET=1`` must be set before ``kernels`` is imported). The pointers are
host addresses: the torch operators' test hook ``FUSED_CONTRASTIVE_AOT_FAKE_CPU=1`` passes CPU data
pointers, so the kernels read and write the operators' own CPU tensors and workspace.

Only ``UPCAST`` differs from the compiled variant: the interpreter's bf16 ``tl.dot`` is wrong, so bf16
variants run with both tiles up-cast after their rounding to bf16 (the JIT launcher does the same under
the interpreter). Everything else, the host logic of ``csrc/fc_api.c`` / ``csrc/fc_torch.cpp`` included,
is the library's.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import struct
import traceback

import torch

_PTR = {"*fp32": torch.float32, "*fp16": torch.float16, "*bf16": torch.bfloat16, "*i64": torch.int64,
        "*i32": torch.int32, "*u8": torch.uint8, "*i8": torch.int8}

_HOOK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p, ctypes.c_uint, ctypes.c_int,
                         ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_void_p))


def _constexpr(text: str):
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def _at(addr: int, dtype: torch.dtype) -> torch.Tensor:
    """A one-element tensor at ``addr`` (the interpreter reads only its address and dtype)."""
    buf = (ctypes.c_char * dtype.itemsize).from_address(addr)
    return torch.frombuffer(buf, dtype=dtype)


def _kernel_fn(name: str):
    from fused_contrastive.kernels import common, lse, panel

    for mod in (lse, panel, common):
        fn = getattr(mod, f"{name}_kernel", None)
        if fn is not None:
            return fn
    raise KeyError(f"no kernel function {name}_kernel in fused_contrastive.kernels.lse / .panel / .common")


class Executor:
    """The hook's state: ``launches`` names the launches run (``ckeys`` their variants' constexpr keys), ``errors``
    collects failures (a failing launch also fails in the library with CUDA_ERROR_LAUNCH_FAILED)."""

    def __init__(self, manifest: dict):
        self.by_sha: dict[str, dict] = {}
        for v in manifest["variants"]:
            self.by_sha.setdefault(v["sha256"], v)
        self.layouts = manifest["layouts"]
        self.launches: list[str] = []
        self.ckeys: list[str] = []  # (each launch's constexpr key, beside its name)
        self.errors: list[str] = []

    def __call__(self, image, size, name, grid_x, nparams, sizes, params) -> int:
        try:
            sha = hashlib.sha256(ctypes.string_at(image, size)).hexdigest()
            v = self.by_sha[sha]
            lay = self.layouts[v["kernel"]]
            if nparams != len(lay) + 2:
                raise RuntimeError(f"{v['kernel']}: {nparams} parameters, the layout has {len(lay)} + 2")
            args = {}
            for i, (p, typ) in enumerate(zip(lay, v["arg_types"], strict=True)):
                raw = ctypes.string_at(params[i], sizes[i])
                if typ.startswith("*"):
                    args[p["name"]] = _at(struct.unpack("<Q", raw)[0], _PTR[typ])
                elif typ == "fp32":
                    args[p["name"]] = struct.unpack("<f", raw)[0]
                elif typ in ("i32", "i64"):
                    args[p["name"]] = int.from_bytes(raw, "little", signed=True)
                else:
                    raise RuntimeError(f"{v['kernel']}: parameter {p['name']} of type {typ}")
            cx = {k: _constexpr(val) for k, val in (kv.split("=", 1) for kv in v["ckey"].split(","))}
            if "UPCAST" in cx and v["dtype"] == "bf16":
                cx["UPCAST"] = True
            _kernel_fn(v["kernel"])[(grid_x,)](**args, **cx)
            self.launches.append(v["kernel"])
            self.ckeys.append(v["ckey"])
            return 0
        except Exception:  # reported through the library (the launch fails) and in self.errors
            self.errors.append(traceback.format_exc())
            return 1


def install(mock_path: str, manifest_path: str) -> Executor:
    """Load the mock driver (the same instance the library dlopens by this path) and install the hook;
    keep the returned executor alive while the library runs."""
    with open(manifest_path) as f:
        ex = Executor(json.load(f))
    lib = ctypes.CDLL(mock_path)
    ex._hook = _HOOK(ex)  # the C function pointer lives as long as the executor
    lib.fc_mock_set_exec(ex._hook)
    return ex
