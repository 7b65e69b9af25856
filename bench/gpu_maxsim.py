"""Late interaction on a CUDA device: parity of ``maxsim_info_nce``'s Triton kernels and its chunked
PyTorch path against a float64 computation of the definition, then forward + backward timings of the
Triton kernels, the PyTorch path and the materialised textbook computation side by side. Prints plain
text (commit it under ``bench/results/``).

    python bench/gpu_maxsim.py --n 1024,4096 --lq 32 --ld 180 --d 128

Every figure is measured in this run (CUDA events, medians over ``--repeats``); nothing is modelled. The
textbook (``einsum`` of every token similarity, masked max, sum, ``cross_entropy``) runs only where its
predicted memory (the [N, M, Lq, Ld] similarities and their gradient) fits in 60 % of the free memory.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from fused_contrastive import maxsim as MS
from fused_contrastive.core.maxsim import triton_maxsim as TMS
from fused_contrastive.gpu_validate import _timer


def inputs(n: int, lq: int, ld: int, d: int, dtype, seed: int = 0, device="cuda"):
    """Unit token vectors with a ColBERT-like padding pattern (query lengths 8..Lq, document lengths
    Ld/4..Ld), positives correlated with their queries."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(n, lq, d, generator=g)
    docs = torch.randn(n, ld, d, generator=g)
    docs[:, :lq] += 0.5 * q  # document i shares some direction with query i
    qlen = torch.randint(min(8, lq), lq + 1, (n,), generator=g)
    dlen = torch.randint(max(1, ld // 4), ld + 1, (n,), generator=g)
    qm = torch.arange(lq)[None] < qlen[:, None]
    dm = torch.arange(ld)[None] < dlen[:, None]
    q, docs = F.normalize(q, dim=-1), F.normalize(docs, dim=-1)
    return (q.to(device, dtype), docs.to(device, dtype), qm.to(device), dm.to(device))


def textbook(q, docs, qm, dm, scale):
    sims = torch.einsum("nad,mbd->nmab", q, docs)
    sims = sims.masked_fill(~dm[None, :, None, :], torch.finfo(sims.dtype).min)
    s = (sims.max(dim=-1).values.float() * qm[:, None, :]).sum(-1)
    return F.cross_entropy(scale * s, torch.arange(q.shape[0], device=q.device))


def parity(n: int, lq: int, ld: int, d: int) -> bool:
    ok = True
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        q, docs, qm, dm = inputs(n, lq, ld, d, dtype, seed=1)
        q64, d64 = q.double().requires_grad_(), docs.double().requires_grad_()
        want = MS.maxsim_info_nce(q64, d64, query_mask=qm, doc_mask=dm, scale=4.0, normalize=False,
                                  backend="reference")
        gq64, gd64 = torch.autograd.grad(want, (q64, d64))
        want = want.detach()
        for be in ("triton", "triton/dq-onehot", "torch"):
            ql, dl = q.clone().requires_grad_(), docs.clone().requires_grad_()
            TMS.DQ_GATHER = be != "triton/dq-onehot"
            got = MS.maxsim_info_nce(ql, dl, query_mask=qm, doc_mask=dm, scale=4.0, normalize=False,
                                     backend=be.split("/")[0])
            gq, gd = torch.autograd.grad(got, (ql, dl))
            TMS.DQ_GATHER = True
            got = got.detach()
            # against the float64 oracle of the same rounded inputs. The softmax's gradient carries the
            # rounding of the logits s S_ij, |S| <= Lq: fp32 scores round to ~Lq eps_32, times s, relative
            # to the gradient (a first run with a flat 1e-5 for fp32 failed every path, the PyTorch path's
            # included, at 2e-5: that rounding). 16-bit: the gradients come back in the input dtype.
            logit_round = 4 * 4.0 * lq * torch.finfo(torch.float32).eps
            tol = {torch.float32: max(1e-5, logit_round), torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
            el = abs(float(got) - float(want)) / max(1.0, abs(float(want)))
            eq = float((gq.double() - gq64).abs().max() / gq64.abs().max())
            ed = float((gd.double() - gd64).abs().max() / gd64.abs().max())
            good = el < 1e-5 and eq < tol and ed < tol
            ok &= good
            print(f"parity {be:16s} {str(dtype)[6:]:8s} N={n} Lq={lq} Ld={ld} D={d}: loss rel err {el:.2e}, "
                  f"dq {eq:.2e}, dd {ed:.2e} (of the largest entry; bound {tol:g}) {'PASS' if good else 'FAIL'}",
                  flush=True)
    return ok


def timing(n: int, lq: int, ld: int, d: int, repeats: int, with_torch: bool, profile: bool = True) -> None:
    measure = _timer("cuda")
    q, docs, qm, dm = inputs(n, lq, ld, d, torch.bfloat16)
    leaves = [q.requires_grad_(), docs.requires_grad_()]
    cells = []
    free = torch.cuda.mem_get_info()[0]
    need = 3 * n * n * lq * ld * 2  # bf16 similarities, the max's gradient, the masked copy
    runs = [("triton", lambda: MS.maxsim_info_nce(q, docs, query_mask=qm, doc_mask=dm, normalize=False,
                                                  backend="triton")),
            ("triton/dq-onehot", lambda: MS.maxsim_info_nce(q, docs, query_mask=qm, doc_mask=dm, normalize=False,
                                                            backend="triton")),
            ("torch", lambda: MS.maxsim_info_nce(q, docs, query_mask=qm, doc_mask=dm, normalize=False,
                                                 backend="torch")),
            ("textbook", lambda: textbook(q, docs, qm, dm, 1.0))]
    for name, fn in runs:
        if name == "torch" and not with_torch:
            continue
        if name == "textbook" and need > 0.6 * free:
            cells.append(f"textbook does not fit (needs ~{need / 2**30:.0f} GiB of {free / 2**30:.0f} free)")
            continue

        def step(fn=fn):
            for x in leaves:
                x.grad = None
            fn().backward()

        TMS.DQ_GATHER = name != "triton/dq-onehot"
        try:
            step()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            ms = statistics.median(measure(step) for _ in range(repeats))
            peak = torch.cuda.max_memory_allocated() / 2**20
            cells.append(f"{name} {ms:.2f} ms (peak {peak:.0f} MiB)")
        except torch.cuda.OutOfMemoryError:
            cells.append(f"{name} out of memory")
        if name == "triton" and profile:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                step()
                torch.cuda.synchronize()
            events = sorted((e for e in prof.key_averages() if e.self_device_time_total > 0),
                            key=lambda e: -e.self_device_time_total)
            print(f"kernels of one triton step at N={n}: " + "; ".join(
                f"{e.key[:40]} {e.self_device_time_total / 1e3:.2f} ms" for e in events[:6]), flush=True)
        TMS.DQ_GATHER = True
        torch.cuda.empty_cache()
    print(f"timing N=M={n} Lq={lq} Ld={ld} D={d} bf16 fwd+bwd, median of {repeats}: " + "; ".join(cells), flush=True)


def sweep(n: int, lq: int, ld: int, d: int, repeats: int, parity_n: int, only: list[str] | None = None) -> None:
    """Every setting of ``triton_maxsim.sweep_settings()`` (kernel variants and launch configurations):
    bf16 parity against the float64 oracle at ``parity_n``, then fwd + bwd at N = ``n`` (median) and the
    device time of each kernel, side by side in this run."""
    measure = _timer("cuda")
    q, docs, qm, dm = inputs(n, lq, ld, d, torch.bfloat16)
    q.requires_grad_()
    docs.requires_grad_()
    pq, pd, pqm, pdm = inputs(parity_n, lq, ld, d, torch.bfloat16, seed=1)
    q64, d64 = pq.double().requires_grad_(), pd.double().requires_grad_()
    want = MS.maxsim_info_nce(q64, d64, query_mask=pqm, doc_mask=pdm, scale=4.0, normalize=False,
                              backend="reference")
    gq64, gd64 = torch.autograd.grad(want, (q64, d64))

    def step():
        q.grad = docs.grad = None
        MS.maxsim_info_nce(q, docs, query_mask=qm, doc_mask=dm, normalize=False, backend="triton").backward()

    for name, _ in TMS.sweep_settings():
        if only and name not in only:
            continue
        try:
            with TMS.settings(name):
                ql, dl = pq.clone().requires_grad_(), pd.clone().requires_grad_()
                got = MS.maxsim_info_nce(ql, dl, query_mask=pqm, doc_mask=pdm, scale=4.0, normalize=False,
                                         backend="triton")
                gq, gd = torch.autograd.grad(got, (ql, dl))
                err = max(abs(float(got.detach()) - float(want.detach())) / max(1.0, abs(float(want.detach()))),
                          float((gq.double() - gq64).abs().max() / gq64.abs().max()),
                          float((gd.double() - gd64).abs().max() / gd64.abs().max()))
                step()
                ms = statistics.median(measure(step) for _ in range(repeats))
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                    step()
                    torch.cuda.synchronize()
            kern = {e.key: e.self_device_time_total / 1e3 for e in prof.key_averages()
                    if e.key.startswith("maxsim")}
            print(f"sweep {name:12s} N={n}: fwd+bwd {ms:.2f} ms; " + ", ".join(
                f"{k.removesuffix('_kernel')} {v:.2f}" for k, v in sorted(kern.items()))
                + f"; parity bf16 N={parity_n} max rel err {err:.2e} {'PASS' if err < 1.6e-2 else 'FAIL'}",
                flush=True)
        except Exception as e:  # noqa: BLE001 - a setting that fails: say so, go on
            print(f"sweep {name}: raised {type(e).__name__}: {str(e).splitlines()[0][:200]}", flush=True)
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", default="1024,4096", help="comma-separated N = M of the timings")
    ap.add_argument("--lq", type=int, default=32)
    ap.add_argument("--ld", type=int, default=180)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--parity-n", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--torch-max-n", type=int, default=1024, help="time the PyTorch path up to this N")
    ap.add_argument("--sweep", type=int, default=0, metavar="N",
                    help="time every setting of triton_maxsim.sweep_settings() at this N instead")
    ap.add_argument("--only", default="", help="with --sweep: these settings only (comma-separated)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/gpu_maxsim.py needs a CUDA device", file=sys.stderr)
        return 2
    t0 = time.time()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {__import__('triton').__version__}")
    if args.sweep:
        sweep(args.sweep, args.lq, args.ld, args.d, args.repeats, args.parity_n,
              [x for x in args.only.split(",") if x])
        print(f"\nwall {time.time() - t0:.0f} s")
        return 0
    ok = parity(args.parity_n, args.lq, args.ld, args.d)
    for n in (int(x) for x in args.n.split(",")):
        timing(n, args.lq, args.ld, args.d, args.repeats, n <= args.torch_max_n)
    print(f"\nparity {'PASS' if ok else 'FAIL'}; wall {time.time() - t0:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
