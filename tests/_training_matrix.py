"""Helpers of tests/test_training_matrix.py: a tiny offline encoder with buffers, the matrix's loss cells
(the library's call and an independent textbook computation of the same loss, written from the math on
materialised cosine logits), one optimizer-free training step, and the 2-rank gloo DDP worker.

Every cell's data is a dict of tensors that share the batch dimension (dim 0), so a rank's share of
the global batch is a slice of every tensor."""

from __future__ import annotations

import io
import traceback
from contextlib import nullcontext
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import fused_contrastive as fc
from fused_contrastive.testing.baselines import dcl_formula

VOCAB, WIDTH, DIM, TOKENS = 16, 8, 6, 4
#: the global batch and its split over the 2 DDP ranks (uneven on purpose)
SIZES = [5, 3]
N = sum(SIZES)
CHUNK = 2  # encode_in_chunks' chunk size: 3 chunks on rank 0, 2 on rank 1


class TinyEncoder(nn.Module):
    """Token ids [n, TOKENS] -> embeddings [n, DIM]: Embedding, mean over tokens, Linear, BatchNorm1d in
    eval mode (running statistics are buffers DDP broadcasts), tanh, LayerNorm, a registered shift
    buffer, Linear. 286 parameters. The shift sits before the last Linear so that under autocast the
    embeddings come out in bfloat16."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(1234)
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.bn = nn.BatchNorm1d(WIDTH)
        self.norm = nn.LayerNorm(WIDTH)
        self.out = nn.Linear(WIDTH, DIM)
        self.register_buffer("shift", 0.1 * torch.randn(WIDTH, generator=g))
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            self.bn.running_mean.copy_(0.2 * torch.randn(WIDTH, generator=g))
            self.bn.running_var.copy_(0.5 + torch.rand(WIDTH, generator=g))
        self.bn.eval()

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.emb(tokens).mean(1)
        x = torch.tanh(self.bn(self.lin(x)))
        return self.out(self.norm(x) + self.shift)


# ------------------------------------------------------------------------------------------------
# textbook losses (float64 ground truth when given float64 embeddings); from the math, not the library
# ------------------------------------------------------------------------------------------------

def _cos(a: Tensor, b: Tensor) -> Tensor:
    return F.normalize(a, dim=-1) @ F.normalize(b, dim=-1).T


def tb_info_nce(q: Tensor, k: Tensor, scale) -> Tensor:
    return F.cross_entropy(_cos(q, k) * scale, torch.arange(q.shape[0]))


def tb_clip(a: Tensor, b: Tensor, scale) -> Tensor:
    logits = _cos(a, b) * scale
    t = torch.arange(a.shape[0])
    return (F.cross_entropy(logits, t) + F.cross_entropy(logits.T, t)) / 2


def tb_simcse_sup(a: Tensor, p: Tensor, n: Tensor, t: float, hnw: float) -> Tensor:
    b = a.shape[0]
    logits = torch.cat([_cos(a, p), _cos(a, n)], 1) / t
    logits = logits + hnw * torch.cat([torch.zeros(b, b), torch.eye(b)], 1).to(logits)
    return F.cross_entropy(logits, torch.arange(b))


def _log_prob_without_self(logits: Tensor, self_mask: Tensor) -> Tensor:
    logits = logits.masked_fill(self_mask, float("-inf"))
    return logits - torch.logsumexp(logits, 1, keepdim=True)


def tb_supcon(feats: Tensor, labels: Tensor, t: float, bt: float) -> Tensor:
    """SupCon L_out, every view an anchor, views concatenated view-major."""
    bsz, v, _ = feats.shape
    x = feats.transpose(0, 1).reshape(v * bsz, -1)
    lab = labels.repeat(v)
    eye = torch.eye(v * bsz, dtype=torch.bool)
    logp = _log_prob_without_self(_cos(x, x) / t, eye)
    pos = (lab[:, None] == lab[None, :]) & ~eye
    mean_pos = torch.where(pos, logp, torch.zeros_like(logp)).sum(1) / pos.sum(1).clamp(min=1)
    return (-(t / bt) * mean_pos).mean()


def tb_dscl(feats: Tensor, labels: Tensor, beta: float, t: float) -> Tensor:
    """DSCL: anchors view 0, contrast [view 0; view 1], self excluded; own view 1 weight 1, each other
    positive beta / (|P| - 1); -(sum_j w log p) / sum_j w, base temperature = temperature."""
    bsz = feats.shape[0]
    anchors, contrast = feats[:, 0], torch.cat([feats[:, 0], feats[:, 1]])
    lab = torch.cat([labels, labels])
    self_mask = torch.zeros(bsz, 2 * bsz, dtype=torch.bool)
    self_mask[torch.arange(bsz), torch.arange(bsz)] = True
    logp = _log_prob_without_self(_cos(anchors, contrast) / t, self_mask)
    pos = (labels[:, None] == lab[None, :]) & ~self_mask
    own = torch.zeros_like(pos)
    own[torch.arange(bsz), bsz + torch.arange(bsz)] = True
    others = (pos & ~own).sum(1, keepdim=True)
    w = torch.where(own, 1.0, torch.where(pos, beta / others.clamp(min=1), 0.0)).to(logp)
    per = -(torch.where(w > 0, w * logp, torch.zeros_like(logp))).sum(1) / w.sum(1)
    return per.mean()


def tb_gist(a: Tensor, p: Tensor, n: Tensor, ga: Tensor, gp: Tensor, gn: Tensor, t: float, margin: float) -> Tensor:
    """GISTEmbed without the anchor-anchor block: row i = [cos(a_i, p) | cos(p_i, p) | cos(a_i, n)] / t, a
    column dropped where the guide's cosine of the pair is > cos(ga_i, gp_i) - margin (the positive kept)."""
    rows = torch.arange(a.shape[0])
    theta = (F.normalize(ga, dim=-1) * F.normalize(gp, dim=-1)).sum(1, keepdim=True) - margin
    keep_pos = torch.zeros(a.shape[0], p.shape[0], dtype=torch.bool)
    keep_pos[rows, rows] = True
    blocks = [(_cos(a, p), (_cos(ga, gp) > theta) & ~keep_pos), (_cos(p, p), _cos(gp, gp) > theta),
              (_cos(a, n), _cos(ga, gn) > theta)]
    logits = torch.cat([(c / t).masked_fill(m, float("-inf")) for c, m in blocks], dim=1)
    return F.cross_entropy(logits, rows)


def tb_qwen3(q: Tensor, d: Tensor, h: Tensor, t: float, margin: float) -> Tensor:
    """The Qwen3-Embedding InfoNCE: row i = [cos(q_i, d) | cos(q_i, h_i) | cos(q_i, q_j) | cos(d_i, d_j)] / t
    (j != i in the last two), a candidate dropped where its cosine is > cos(q_i, d_i) + margin, the positive
    kept."""
    n = q.shape[0]
    eye = torch.eye(n, dtype=torch.bool)
    cqd = _cos(q, d)
    bound = cqd.diagonal()[:, None] + margin
    own = (F.normalize(q, dim=-1)[:, None, :] * F.normalize(h, dim=-1)).sum(-1)
    blocks = [(cqd, (cqd > bound) & ~eye), (own, own > bound), (_cos(q, q), (_cos(q, q) > bound) | eye),
              (_cos(d, d), (_cos(d, d) > bound) | eye)]
    logits = torch.cat([(c / t).masked_fill(m, float("-inf")) for c, m in blocks], dim=1)
    return F.cross_entropy(logits, torch.arange(n))


def _guide(tokens: Tensor) -> Tensor:
    """A frozen guide model: fixed random token embeddings, mean-pooled (no gradient)."""
    w = torch.randn(VOCAB, 5, generator=torch.Generator().manual_seed(11))
    return w[tokens].mean(1)


def tb_cosent(u: Tensor, v: Tensor, y: Tensor, scale: float) -> Tensor:
    return tb_cosent_scores((F.normalize(u, dim=-1) * F.normalize(v, dim=-1)).sum(1), y, scale)


def tb_cosent_scores(s: Tensor, y: Tensor, scale: float) -> Tensor:
    """log(1 + sum over pairs with y_a > y_b of exp(scale * (s_b - s_a)))."""
    diff = scale * (s[None, :] - s[:, None])  # [a, b] = scale * (s_b - s_a)
    terms = diff[y[:, None] > y[None, :]]
    return torch.logsumexp(torch.cat([terms, torch.zeros(1, dtype=terms.dtype)]), 0)


def tb_siglip(img: Tensor, txt: Tensor, scale, bias) -> Tensor:
    n = img.shape[0]
    z = scale * _cos(img, txt) + bias
    sign = (2 * torch.eye(n) - 1).to(z.dtype)
    return -F.logsigmoid(sign * z).sum() / n


# ------------------------------------------------------------------------------------------------
# cells
# ------------------------------------------------------------------------------------------------

def _tokens(g: torch.Generator, *lead: int) -> Tensor:
    return torch.randint(0, VOCAB, (*lead, TOKENS), generator=g)


def _two_views(enc, tokens: Tensor) -> Tensor:
    """[n, 2, TOKENS] -> features [n, 2, DIM] (each view encoded by its own call)."""
    return torch.stack([enc(tokens[:, 0].contiguous()), enc(tokens[:, 1].contiguous())], 1)


@dataclass
class Cell:
    """One loss of the matrix. ``ours(enc, data, module, gather)`` and ``textbook(enc, data, module)``
    return the 0-dim loss of the batch in ``data`` (``enc`` maps token ids to embeddings); ``module``
    builds the drop-in (its parameters, if any, are trained too) or is None for a functional loss."""

    name: str
    data: Callable[[torch.Generator], dict[str, Tensor]]
    ours: Callable
    textbook: Callable
    module: Callable[[bool], nn.Module] | None = None


def _prefix(x: Tensor, d: int) -> Tensor:
    """A Matryoshka level's rows: the first ``d`` coordinates, re-normalised."""
    return F.normalize(x[..., :d], dim=-1)


def _pairs(g):
    return {"a": _tokens(g, N), "b": _tokens(g, N)}


def _triples(g):
    return {"a": _tokens(g, N), "b": _tokens(g, N), "c": _tokens(g, N)}


def _views(g):
    return {"x": _tokens(g, N, 2), "y": torch.tensor([0, 1, 0, 2, 1, 0, 2, 1])}


def _scored(g):
    return {"a": _tokens(g, N), "b": _tokens(g, N), "y": torch.tensor([0.0, 3, 1, 2, 3, 0, 1, 2])}


CELLS: list[Cell] = [
    Cell("info_nce", _pairs,
         lambda e, d, m, g: fc.info_nce(e(d["a"]), e(d["b"]), temperature=0.1, gather=g),
         lambda e, d, m: tb_info_nce(e(d["a"]), e(d["b"]), 10.0)),
    Cell("simcse_loss", _pairs,
         lambda e, d, m, g: fc.simcse_loss(e(d["a"]), e(d["b"]), gather=g),
         lambda e, d, m: tb_info_nce(e(d["a"]), e(d["b"]), 20.0)),
    Cell("simcse_sup_loss", _triples,
         lambda e, d, m, g: fc.simcse_sup_loss(e(d["a"]), e(d["b"]), e(d["c"]), temperature=0.1,
                                               hard_negative_weight=0.5, gather=g),
         lambda e, d, m: tb_simcse_sup(e(d["a"]), e(d["b"]), e(d["c"]), 0.1, 0.5)),
    Cell("clip_loss", _pairs,
         lambda e, d, m, g: fc.clip_loss(e(d["a"]), e(d["b"]), 10.0, gather=g),
         lambda e, d, m: tb_clip(e(d["a"]), e(d["b"]), 10.0)),
    Cell("supcon_loss", _views,
         lambda e, d, m, g: fc.supcon_loss(_two_views(e, d["x"]), d["y"], temperature=0.1, gather=g),
         lambda e, d, m: tb_supcon(_two_views(e, d["x"]), d["y"], 0.1, 0.07)),
    Cell("dscl_loss", _views,
         lambda e, d, m, g: fc.dscl_loss(_two_views(e, d["x"]), d["y"], temperature=0.1, gather=g),
         lambda e, d, m: tb_dscl(_two_views(e, d["x"]), d["y"], 8.0, 0.1)),
    # Matryoshka levels (the one-pass core) against the textbook loss per level on F.normalize(x[..., :d])
    Cell("info_nce+matryoshka", _pairs,
         lambda e, d, m, g: fc.info_nce(e(d["a"]), e(d["b"]), temperature=0.1, gather=g, matryoshka_dims=[6, 2, 4],
                                        matryoshka_weights=[1.0, 0.5, 2.0]),
         lambda e, d, m: sum(w * tb_info_nce(_prefix(e(d["a"]), k), _prefix(e(d["b"]), k), 10.0)
                             for k, w in ((6, 1.0), (2, 0.5), (4, 2.0)))),
    Cell("supcon_loss+matryoshka", _views,
         lambda e, d, m, g: fc.supcon_loss(_two_views(e, d["x"]), d["y"], temperature=0.1, gather=g,
                                           matryoshka_dims=[3, 6]),
         lambda e, d, m: sum(tb_supcon(_prefix(_two_views(e, d["x"]), k), d["y"], 0.1, 0.07) for k in (3, 6))),
    Cell("gist_loss", _triples,
         lambda e, d, m, g: fc.gist_loss(e(d["a"]), e(d["b"]), e(d["c"]),
                                         guide=(_guide(d["a"]), _guide(d["b"]), _guide(d["c"])), temperature=0.1,
                                         margin=0.01, contrast_anchors=False, gather=g),
         lambda e, d, m: tb_gist(e(d["a"]), e(d["b"]), e(d["c"]), _guide(d["a"]), _guide(d["b"]), _guide(d["c"]),
                                 0.1, 0.01)),
    Cell("qwen3_embedding_loss", _triples,  # each query's own hard negative: the third tokens' embedding
         lambda e, d, m, g: fc.qwen3_embedding_loss(e(d["a"]), e(d["b"]), e(d["c"])[:, None], temperature=0.1,
                                                    margin=0.05, gather=g),
         lambda e, d, m: tb_qwen3(e(d["a"]), e(d["b"]), e(d["c"])[:, None], 0.1, 0.05)),
    Cell("dcl_loss", _pairs,
         lambda e, d, m, g: fc.dcl_loss(e(d["a"]), e(d["b"]), temperature=0.2, gather=g),
         lambda e, d, m: dcl_formula(e(d["a"]), e(d["b"]), 0.2)),
    Cell("dclw_loss", _pairs,
         lambda e, d, m, g: fc.dclw_loss(e(d["a"]), e(d["b"]), temperature=0.2, sigma=0.5, gather=g),
         lambda e, d, m: dcl_formula(e(d["a"]), e(d["b"]), 0.2, 0.5)),
    Cell("cosent_loss", _scored,
         lambda e, d, m, g: fc.cosent_loss(e(d["a"]), e(d["b"]), d["y"], scale=5.0, gather=g),
         lambda e, d, m: tb_cosent(e(d["a"]), e(d["b"]), d["y"], 5.0)),
    Cell("cosent_loss_from_scores", _scored,  # a dot-product "cross-encoder" score per pair
         lambda e, d, m, g: fc.cosent_loss_from_scores((e(d["a"]) * e(d["b"])).sum(1), d["y"], scale=0.5, gather=g),
         lambda e, d, m: tb_cosent_scores((e(d["a"]) * e(d["b"])).sum(1), d["y"], 0.5)),
    Cell("siglip_loss", _pairs,
         lambda e, d, m, g: fc.siglip_loss(e(d["a"]), e(d["b"]), 5.0, -2.0, gather=g),
         lambda e, d, m: tb_siglip(e(d["a"]), e(d["b"]), 5.0, -2.0)),
    # drop-ins (fused_contrastive.nn); CLIPLoss and SigLIPLoss train their own scale / bias
    Cell("nn.InfoNCELoss", _pairs, lambda e, d, m, g: m(e(d["a"]), e(d["b"])),
         lambda e, d, m: tb_info_nce(e(d["a"]), e(d["b"]), 10.0),
         lambda g: fc.nn.InfoNCELoss(0.1, gather=g)),
    Cell("nn.SimCSELoss", _pairs, lambda e, d, m, g: m(e(d["a"]), e(d["b"])),
         lambda e, d, m: tb_info_nce(e(d["a"]), e(d["b"]), 20.0),
         lambda g: fc.nn.SimCSELoss(gather=g)),
    Cell("nn.SupConLoss", _views, lambda e, d, m, g: m(_two_views(e, d["x"]), d["y"]),
         lambda e, d, m: tb_supcon(_two_views(e, d["x"]), d["y"], 0.1, 0.1),
         lambda g: fc.nn.SupConLoss(0.1, 0.1, gather=g)),
    Cell("nn.DSCLLoss", _views, lambda e, d, m, g: m(_two_views(e, d["x"]), d["y"]),
         lambda e, d, m: tb_dscl(_two_views(e, d["x"]), d["y"], 2.0, 0.1),
         lambda g: fc.nn.DSCLLoss(2.0, 0.1, gather=g)),
    Cell("nn.CoSENTLoss", _scored, lambda e, d, m, g: m(e(d["a"]), e(d["b"]), d["y"]),
         lambda e, d, m: tb_cosent(e(d["a"]), e(d["b"]), d["y"], 5.0),
         lambda g: fc.nn.CoSENTLoss(5.0, gather=g)),
    Cell("nn.CLIPLoss", _pairs, lambda e, d, m, g: m(e(d["a"]), e(d["b"])),
         lambda e, d, m: tb_clip(e(d["a"]), e(d["b"]), m.logit_scale.exp()),
         lambda g: fc.nn.CLIPLoss(0.1, gather=g)),
    Cell("nn.SigLIPLoss", _pairs, lambda e, d, m, g: m(e(d["a"]), e(d["b"])),
         lambda e, d, m: tb_siglip(e(d["a"]), e(d["b"]), m.logit_scale.exp(), m.logit_bias),
         lambda g: fc.nn.SigLIPLoss(5.0, -2.0, gather=g)),
]


def _registry_cell(case) -> Cell:
    """A cell generated from a registry case with ``gather_split="rows"``, ``bench=True`` and [N, D]
    embeddings: each embedding input is the encoder's output for its own token rows, the row-sized
    options (labels) are data split with them, the rest are the case's options; the textbook is the
    case's benchmark formula (``testing.baselines.formula_of``), written independently of the library."""
    from fused_contrastive.testing.baselines import formula_of

    tensors, kw = case.build(N, DIM, torch.Generator().manual_seed(0))
    emb = [k for k, v in tensors.items() if v.dim() == 2]
    rowed = {k: v for k, v in kw.items() if isinstance(v, Tensor) and v.dim() >= 1}
    const = {k: v for k, v in kw.items() if k not in rowed}
    formula = formula_of(case.name).fn

    def data(g):
        return {**{k: _tokens(g, N) for k in emb}, **{k: v.clone() for k, v in rowed.items()}}

    def inputs(e, d):
        return {**{k: e(d[k]) for k in emb}, **{k: d[k] for k in rowed}, **const}

    return Cell(f"{case.fn.__name__}[{case.name}]", data, lambda e, d, m, g: case.fn(**inputs(e, d), gather=g),
                lambda e, d, m: formula(inputs(e, d)))


def registry_cells(hand_written: list[Cell]) -> list[Cell]:
    """Generated cells for the gathering losses no hand-written cell calls: one per function, from its
    first case that qualifies (:func:`_registry_cell`)."""
    from fused_contrastive.testing import CASES

    done = {c.name.split("[")[0] for c in hand_written}
    out = []
    for case in CASES:
        tensors, _ = case.build(4, 3, torch.Generator().manual_seed(0))
        if (case.gather_split != "rows" or not case.bench or case.fn.__name__ in done
                or any(v.dim() != 2 for v in tensors.values())):
            continue
        out.append(_registry_cell(case))
        done.add(case.fn.__name__)
    return out


CELLS += registry_cells(CELLS)
BY_NAME = {c.name: c for c in CELLS}


def global_data(cell: Cell) -> dict[str, Tensor]:
    return cell.data(torch.Generator().manual_seed(7))


def local_data(data: dict[str, Tensor], rank: int) -> dict[str, Tensor]:
    off = sum(SIZES[:rank])
    return {k: v[off:off + SIZES[rank]] for k, v in data.items()}


# ------------------------------------------------------------------------------------------------
# one training step
# ------------------------------------------------------------------------------------------------

def step(cell: Cell, model: nn.Module, loss_mod: nn.Module | None, data: dict[str, Tensor], *, textbook: bool,
         chunks: bool = False, bf16: bool = False, gather: bool = False, encode=None) -> dict[str, Tensor]:
    """Forward, loss, backward (no optimizer); returns every trained parameter's gradient by name
    (``loss.<name>`` for the drop-in's own parameters). ``model`` may be a DDP wrapper; ``encode``
    (token ids -> embeddings) replaces calling ``model`` directly."""
    enc = (lambda t: fc.encode_in_chunks(model, t, CHUNK)) if chunks else model
    enc = encode if encode is not None else enc
    params = dict(model.named_parameters())
    params = {k.removeprefix("module."): p for k, p in params.items()}
    if loss_mod is not None:
        params.update({f"loss.{k}": p for k, p in loss_mod.named_parameters()})
    for p in params.values():
        p.grad = None
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else nullcontext()
    with ctx:
        loss = cell.textbook(enc, data, loss_mod) if textbook else cell.ours(enc, data, loss_mod, gather)
    loss.backward()
    return {k: p.grad.detach().clone() for k, p in params.items() if p.grad is not None}


def fresh(cell: Cell, gather: bool = False, dtype: torch.dtype = torch.float32):
    """The encoder and the cell's loss module (or None), both in ``dtype``, freshly initialised."""
    model = TinyEncoder().to(dtype)
    mod = cell.module(gather).to(dtype) if cell.module is not None else None
    return model, mod


def truth_and_same(cell: Cell, bf16: bool):
    """The float64 single-process textbook gradients on the global batch, and the textbook's own
    gradients computing in the cell's precision (fp32, or fp32 weights under autocast bf16)."""
    data = global_data(cell)
    m64, l64 = fresh(cell, dtype=torch.float64)
    truth = step(cell, m64, l64, data, textbook=True)
    m32, l32 = fresh(cell)
    same = step(cell, m32, l32, data, textbook=True, bf16=bf16)
    return truth, same


# ------------------------------------------------------------------------------------------------
# 2-rank DDP worker
# ------------------------------------------------------------------------------------------------

class _GatherRows(torch.autograd.Function):
    """This rank's rows -> every rank's rows (uneven sizes), differentiable: the backward sums the
    gradient every rank's loss puts on the full batch and returns this rank's slice. Written here, not
    taken from the library, so that the textbook's DDP step is independent of the code under test."""

    @staticmethod
    def forward(ctx, x: Tensor, rank: int) -> Tensor:
        import torch.distributed as dist

        ctx.rank = rank
        pad = torch.zeros(max(SIZES), *x.shape[1:], dtype=torch.float32)
        pad[: x.shape[0]] = x.float()
        parts = [torch.empty_like(pad) for _ in SIZES]
        dist.all_gather(parts, pad)
        return torch.cat([p[:s] for p, s in zip(parts, SIZES, strict=True)]).to(x.dtype)

    @staticmethod
    def backward(ctx, g: Tensor):
        import torch.distributed as dist

        total = g.float().contiguous()
        dist.all_reduce(total)
        off = sum(SIZES[: ctx.rank])
        return total[off:off + SIZES[ctx.rank]].to(g.dtype), None


def textbook_ddp_step(cell: Cell, ddp: nn.Module, loss_mod: nn.Module | None, rank: int, *,
                      bf16: bool) -> dict[str, Tensor]:
    """The textbook loss of the global batch on every rank under DDP: each rank encodes its own rows and
    gathers everyone's embeddings (_GatherRows, whose backward sums every rank's gradient of the
    rows, so rank r's rows get ``world`` times their share of the global gradient and DDP's average is
    the global gradient); the loss module's parameters, which every rank trains on the full loss, are
    averaged. The textbook's own error in the DDP setting."""
    import torch.distributed as dist

    world = len(SIZES)
    off = sum(SIZES[:rank])

    def enc(tokens: Tensor) -> Tensor:  # the global token ids -> the global embeddings
        return _GatherRows.apply(ddp(tokens[off:off + SIZES[rank]]), rank)

    grads = step(cell, ddp, loss_mod, global_data(cell), textbook=True, bf16=bf16, encode=enc)
    for k, v in grads.items():
        if k.startswith("loss."):
            dist.all_reduce(v)
            v /= world
    return grads


def ddp_worker(rank: int, world: int, init: str, names: list[str], chunks: bool, bf16: bool, out) -> None:
    """Runs ``names`` in order on DDP(TinyEncoder, broadcast_buffers=True) with gather=True on this rank's
    share of the global batch, and reports {"rank", "grads": {name: grads}, "error": (name, traceback)
    or None}. Stops at the first failing cell: after a failed collective the ranks are out of step."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    res = {"rank": rank, "grads": {}, "textbook": {}, "error": None}
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world, timeout=timedelta(seconds=30))
    try:
        for name in names:
            cell = BY_NAME[name]
            try:
                model, mod = fresh(cell, gather=True)
                ddp = DDP(model, broadcast_buffers=True)
                res["textbook"][name] = textbook_ddp_step(cell, ddp, mod, rank, bf16=bf16)
                model, mod = fresh(cell, gather=True)
                ddp = DDP(model, broadcast_buffers=True)
                grads = step(cell, ddp, mod, local_data(global_data(cell), rank), textbook=False, chunks=chunks,
                             bf16=bf16, gather=True)
                # the drop-in's own parameters are replicated like the encoder's: average them as DDP does
                for k, v in grads.items():
                    if k.startswith("loss."):
                        dist.all_reduce(v)
                        v /= world
                res["grads"][name] = grads
            except Exception:  # noqa: BLE001 - reported; the parent fails this cell and the ones after it
                res["error"] = (name, traceback.format_exc(limit=-8))
                break
    finally:
        buf = io.BytesIO()  # bytes, not tensors: a tensor's shared memory dies with this process
        torch.save(res, buf)
        out.put(buf.getvalue())
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass


__all__ = ["CELLS", "BY_NAME", "Cell", "TinyEncoder", "ddp_worker", "fresh", "global_data", "local_data", "step",
           "truth_and_same"]
