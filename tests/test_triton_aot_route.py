"""The route of ``backend="triton"`` to the ahead-of-time library (``core/lse/library_route.py``), without a build:
which core-op calls it covers, and that a library that cannot be loaded is an error naming the variable
(the route with a built library is tested in tests/test_cmake_build.py)."""

from __future__ import annotations

import pytest
import torch

import fused_contrastive as fc
from fused_contrastive.core.lse import library_route
from fused_contrastive.core.spec import Coeffs, CoreData, CoreSpec

_T = torch.arange(4)


@pytest.mark.parametrize(("b_given", "spec", "data", "coef", "want"), [
    (True, CoreSpec(), CoreData(), Coeffs(lse=1.0), "info_nce"),
    (True, CoreSpec(grad_cols=3), CoreData(), Coeffs(lse=1.0), "info_nce"),
    (True, CoreSpec(), CoreData(), Coeffs(lse=0.5, col=0.5), "clip"),
    (False, CoreSpec(exclude_self=True), CoreData(), Coeffs(lse=1.0), "self"),
    (False, CoreSpec(), CoreData(), Coeffs(lse=1.0), None),  # B is A with its own column kept
    (True, CoreSpec(exclude_self=True, offset=2), CoreData(), Coeffs(lse=1.0), None),
    (True, CoreSpec(normalize=False), CoreData(), Coeffs(lse=1.0), None),
    (True, CoreSpec(bias=0.5), CoreData(bias_col=torch.zeros(4, dtype=torch.int64)), Coeffs(lse=1.0), None),
    (True, CoreSpec(), CoreData(row_labels=torch.zeros(4), col_labels=torch.zeros(4)), Coeffs(lse=1.0, pos=-1.0),
     None),
    (False, CoreSpec(exclude_self=True), CoreData(), Coeffs(lse=1.0, col=1.0), None),
    # the target margin (an additive-margin softmax): its row form is info_nce, its symmetric form clip
    (True, CoreSpec(margin=0.3), CoreData(target=_T), Coeffs(lse=1.0, tgt=1.0), "info_nce"),
    (True, CoreSpec(margin=-0.2), CoreData(target=_T), Coeffs(lse=0.5, col=0.5, tgt=1.0), "clip"),
    (True, CoreSpec(margin=0.3), CoreData(), Coeffs(lse=1.0), None),  # no target: nowhere to put it
    (False, CoreSpec(exclude_self=True, margin=0.3), CoreData(target=_T), Coeffs(lse=1.0, tgt=1.0), None),
    (True, CoreSpec(margin=0.3, exclude_self=True), CoreData(target=_T), Coeffs(lse=1.0, tgt=1.0), None),
])
def test_covered_feature_set(b_given, spec, data, coef, want):
    b = torch.zeros(4, 16) if b_given else None
    assert library_route._mode(b, spec, data, coef) == want


def test_off_without_the_variable(monkeypatch):
    monkeypatch.delenv(library_route.ENV, raising=False)
    a = torch.zeros(4, 16, dtype=torch.bfloat16)
    assert library_route.route(a, a, CoreSpec(), CoreData(), Coeffs(lse=1.0)) is None


@pytest.mark.parametrize(("modes", "want"), [
    ({"info_nce", "clip", "self", "info_nce_margin", "clip_margin"}, ("info_nce", "clip")),
    ({"info_nce", "clip", "self"}, (None, None)),  # built without the margin kernels: the JIT runs it
    ({"info_nce_margin"}, ("info_nce", None)),
])
def test_a_margin_call_is_routed_where_its_kernels_are_built(monkeypatch, modes, want, route):
    """route() sends a target-margin call to the library exactly when the library lists the feature set
    "<mode>_margin" (its kernels with the bias column in cosine units), the plain modes not being enough;
    the same call without a margin needs the plain mode."""
    info = dict(archs=frozenset({"90"}), dtypes=frozenset({"bf16"}), dclasses=frozenset({"128", "big"}),
                modes=frozenset(modes))
    monkeypatch.setenv(library_route.ENV, "libfused_contrastive_torch.so")
    route(AOT_FAKE_CPU="1")
    monkeypatch.setattr(library_route, "build_info", lambda path: info)
    a = torch.zeros(4, 112, dtype=torch.bfloat16)
    data = CoreData(target=torch.arange(4))
    got = tuple(library_route.route(a, a, CoreSpec(margin=0.3), data, Coeffs(lse=w, col=c, tgt=1.0))
                for w, c in ((1.0, None), (0.5, 0.5)))
    assert got == want
    plain = library_route.route(a, a, CoreSpec(), CoreData(), Coeffs(lse=1.0))
    assert plain == ("info_nce" if "info_nce" in modes else None)


def test_unloadable_library_is_an_error(monkeypatch, tmp_path, route):
    """The variable asks for the library: a path that does not load raises, naming the variable (no
    silent fall-back to the JIT kernels)."""
    missing = tmp_path / "no-such-libfused_contrastive_torch.so"
    monkeypatch.setenv(library_route.ENV, str(missing))
    route(DENSE="0")
    q = torch.randn(64, 32, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=library_route.ENV):
        fc.info_nce(q, q.flip(0), temperature=0.05, backend="triton")


def test_rows_the_library_takes():
    """Rows the library's kernels take (D and row stride multiples of 16, 16-byte aligned), judged
    without copying: rows whose inner stride is not 1 are copied by the operator into a fresh,
    contiguous, aligned buffer."""
    base = torch.zeros(40, 800, dtype=torch.bfloat16)
    assert library_route._rows_fit(base[:, :784])  # stride 800
    assert not library_route._rows_fit(torch.zeros(4, 100, dtype=torch.bfloat16))  # D not a multiple of 16
    assert not library_route._rows_fit(torch.zeros(4, 791, dtype=torch.bfloat16)[:, :784])  # stride D + 7
    assert library_route._rows_fit(base[:, 8:792])  # 8 bf16 = 16 bytes in: aligned
    assert not library_route._rows_fit(base[:, 1:785])  # 2-byte offset: misaligned
    assert library_route._rows_fit(torch.zeros(32, 40).T)  # inner stride 40: the operator copies it


def test_every_field_of_the_contract_is_decided_for_the_library():
    """The ahead-of-time route knows how it treats each field of the core op's contract: a field added to
    CoreSpec, CoreData or Coeffs fails here until library_route.FIELDS (and _mode) decide it, so the C
    library never silently ignores a new option."""
    from dataclasses import fields

    contract = {f"{cls.__name__}.{f.name}" for cls in (CoreSpec, CoreData, Coeffs) for f in fields(cls)}
    assert set(library_route.FIELDS) == contract, (
        f"decide in core/lse/library_route.py FIELDS (and _mode): {sorted(contract - set(library_route.FIELDS))}; "
        f"stale: {sorted(set(library_route.FIELDS) - contract)}")
