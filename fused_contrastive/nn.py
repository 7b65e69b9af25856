"""``torch.nn.Module`` wrappers of the losses: hold the options (including ``gather``), call the functional
form."""

from __future__ import annotations

import inspect
import math
import sys
from collections.abc import Callable

import torch
from torch import Tensor, nn

from . import _validate as V
from . import losses as L
from .cosent import cosent_loss
from .losses import _levels
from .maxsim import maxsim_info_nce
from .siglip import siglip_loss


def _validated(fn, *args, **kw) -> None:
    """Run ``fn`` once on a tiny float64 CPU problem with the module's options (reference backend, no
    gather): a bad option raises here, at construction, with the functional form's own message."""
    kw = dict(kw, backend="reference", gather=False)
    # Matryoshka levels: checked here but for the bound D (the probe's D is tiny), which forward checks
    dims, weights = kw.pop("matryoshka_dims", None), kw.pop("matryoshka_weights", None)
    ret = kw.pop("return_level_losses", False)
    if dims is not None:
        _levels.levels(dims, weights, sys.maxsize)
        if not isinstance(ret, bool):
            raise TypeError(f"return_level_losses must be a bool, got {type(ret).__name__}")
    elif weights is not None or ret:
        fn(*args, **kw, matryoshka_weights=weights, return_level_losses=ret)  # its error names the argument
    fn(*args, **kw)


def _gather_option(gather) -> None:
    import torch.distributed as dist

    if not (gather is False or gather is None or gather is True or isinstance(gather, dist.ProcessGroup)):
        raise TypeError(f"gather must be False, True or a torch.distributed ProcessGroup, got {type(gather).__name__}")


def _x(*shape: int) -> Tensor:
    return torch.linspace(-1.0, 1.0, math.prod(shape), dtype=torch.float64).reshape(shape) + 0.1


def loss_module(name: str, fn: Callable[..., Tensor], probe: Callable[[dict], tuple], *,
                positional: tuple[str, ...] = (), forward_options: tuple[str, ...] = ()) -> type[nn.Module]:
    """The module form of the functional loss ``fn``, derived from its signature.

    ``__init__`` takes ``fn``'s keyword-only options with ``fn``'s defaults (those in ``positional``
    also by position, in that order) and validates them at once on the tiny float64 problem
    ``probe(options)`` returns (reference backend, no gather; a trailing dict holds values for
    ``forward_options`` the function requires): a bad option raises at construction with ``fn``'s own
    message. ``forward`` takes ``fn``'s positional tensors, then the keyword-only inputs named in
    ``forward_options`` (a queue, a guide; by position too), and calls ``fn`` with the held options.
    """
    P = inspect.Parameter
    params = inspect.signature(fn).parameters
    tensors = [p for p in params.values() if p.kind is P.POSITIONAL_OR_KEYWORD]
    options = [p for p in params.values() if p.kind is P.KEYWORD_ONLY and p.name not in forward_options]
    unknown = set(positional) - {p.name for p in options}
    if unknown:
        raise TypeError(f"{name}: {sorted(unknown)} are not options of {fn.__name__}")
    first = [params[o].replace(kind=P.POSITIONAL_OR_KEYWORD) for o in positional]
    rest = [p for p in options if p.name not in positional]
    # a function that takes a tensor temperature: the module can own it as a parameter (learn_temperature)
    learnable = any(p.name == "temperature" for p in options)
    extra = [P("learn_temperature", P.KEYWORD_ONLY, default=False)] if learnable else []
    init_sig = inspect.Signature([P("self", P.POSITIONAL_OR_KEYWORD), *first, *rest, *extra])
    # forward options after the tensors, None by default (a required one, GIST's guide, raises in fn)
    def fwd_param(k: str) -> inspect.Parameter:
        d = params[k].default
        return params[k].replace(kind=P.POSITIONAL_OR_KEYWORD, default=None if d is P.empty else d)

    fwd_sig = inspect.Signature([P("self", P.POSITIONAL_OR_KEYWORD), *tensors, *map(fwd_param, forward_options)])

    def __init__(self, *args, **kwargs) -> None:
        nn.Module.__init__(self)
        try:
            bound = init_sig.bind(self, *args, **kwargs)
        except TypeError as e:  # name the class and what it takes by position
            by_pos = ", ".join(positional) or "no options"
            raise TypeError(f"{name}: {e} (by position it takes {by_pos}; the other options by keyword)") from None
        bound.apply_defaults()
        self.kw = {k: v for k, v in bound.arguments.items() if k != "self"}
        learn = self.kw.pop("learn_temperature", False)
        V.flag("learn_temperature", learn)
        if learn:  # log(temperature) a parameter: exp keeps the temperature > 0 whatever the optimizer does
            t = self.kw["temperature"]
            if isinstance(t, Tensor) or self.kw.get("scale") is not None:
                raise ValueError("learn_temperature=True makes log(temperature) a parameter of the module: give "
                                 "temperature as a number (its initial value), or pass an nn.Parameter as temperature "
                                 "without learn_temperature")
            t0 = _DEFAULT_TEMPERATURE if t is None else t
            V.positive_number("temperature", t0, device=torch.device("cpu"))
            self.kw["temperature"] = float(t0)
        _gather_option(self.kw["gather"])
        if "backend" in self.kw:  # the probe below runs the reference backend: the choice is checked here
            V.backend(self.kw["backend"])
        tiny = probe(self.kw)  # positional inputs, then (optionally) a dict of forward-option inputs
        extra = tiny[-1] if tiny and isinstance(tiny[-1], dict) else {}
        _validated(fn, *(tiny[:-1] if extra else tiny), **extra, **self.kw)
        # a tensor option (a learnable temperature) belongs to the module: an nn.Parameter is registered as a
        # parameter (parameters(), state_dict(), .to(), an optimizer built from the module train it), another
        # tensor as a buffer; forward reads the registered one, so a loaded state or a move takes effect
        self.log_temperature = nn.Parameter(torch.tensor(math.log(self.kw["temperature"]))) if learn else None
        self._tensor_options = []
        for k, v in self.kw.items():
            if isinstance(v, nn.Parameter):
                self.register_parameter(k, v)
            elif isinstance(v, Tensor):
                self.register_buffer(k, v)
            else:
                continue
            self._tensor_options.append(k)

    def forward(self, *args, **kwargs) -> Tensor:
        bound = fwd_sig.bind(self, *args, **kwargs)
        bound.apply_defaults()
        got = bound.arguments
        kw = {k: (getattr(self, k) if k in self._tensor_options else v) for k, v in self.kw.items()}
        if self.log_temperature is not None:
            kw["temperature"] = self.log_temperature.exp()
        return fn(*(got[p.name] for p in tensors), **{k: got[k] for k in forward_options}, **kw)

    def extra_repr(self) -> str:
        out = ", ".join(f"{k}={v!r}" for k, v in self.kw.items() if v is not params[k].default)
        return out + (", learn_temperature=True" if self.log_temperature is not None else "")

    __init__.__signature__ = init_sig
    forward.__signature__ = fwd_sig
    call = ", ".join([p.name for p in tensors] + [f"{k}=None" for k in forward_options])
    init = ", ".join(str(p.replace(annotation=P.empty)) for p in [*first, *rest])
    doc = (f"Module form of :func:`fused_contrastive.{fn.__name__}`: ``{name}({init})``"
           f" holds the options (validated at construction); ``forward({call})`` calls the function with "
           "them. Shapes, dtypes, defaults and backends: the function's docstring.")
    cls = type(name, (nn.Module,), {"__init__": __init__, "forward": forward, "extra_repr": extra_repr,
                                    "__doc__": doc, "__module__": __name__, "__qualname__": name})
    return cls


_LABELS = torch.tensor([0, 0])
#: the temperature a module with ``learn_temperature=True`` starts from when its function's default is None
#: (``info_nce``: "neither temperature nor scale means 0.05")
_DEFAULT_TEMPERATURE = 0.05

#: the functional loss each derived module wraps, filled by :func:`_derived` (``tests/test_registry.py``
#: checks that every public loss function has a module here or among the hand-written classes below, or
#: is listed as function-only); ``__all__`` follows it
DERIVED: dict[type[nn.Module], Callable[..., Tensor]] = {}


def _derived(name: str, fn: Callable[..., Tensor], probe: Callable[[dict], tuple], **kw) -> type[nn.Module]:
    """:func:`loss_module` for the library's own losses: also registered in :data:`DERIVED` and
    ``__all__`` (a new loss's module form is this one line)."""
    cls = loss_module(name, fn, probe, **kw)
    DERIVED[cls] = fn
    return cls


# one line per functional loss: its module, the options also taken by position, a tiny valid problem
_MASKS = ("guide", "ids")  # per-batch inputs of the masked rows: forward arguments, not options
InfoNCELoss = _derived("InfoNCELoss", L.info_nce, lambda kw: (
    _x(2, 2), _x(2, 2).flip(0), None if kw["symmetric"] is True else torch.tensor([1, 0])), positional=("temperature",),
    forward_options=(*_MASKS, "row_negatives"))
SimCSELoss = _derived("SimCSELoss", L.simcse_loss, lambda kw: (_x(4, 2),), positional=("temperature",),
                      forward_options=_MASKS)
SimCSESupLoss = _derived("SimCSESupLoss", L.simcse_sup_loss, lambda kw: (_x(6, 2),), positional=("temperature",),
                         forward_options=_MASKS)
GISTLoss = _derived("GISTLoss", L.gist_loss, lambda kw: (_x(2, 2), _x(2, 2).flip(0), None,
                                                       {"guide": (_x(2, 3), _x(2, 3).flip(0))}),
                    positional=("temperature",), forward_options=("guide",))
SupConLoss = _derived("SupConLoss", L.supcon_loss, lambda kw: (_x(2, 2, 2), _LABELS),
                      positional=("temperature", "base_temperature"), forward_options=("queue", "queue_labels"))
DSCLLoss = _derived("DSCLLoss", L.dscl_loss, lambda kw: (_x(2, 2, 2), _LABELS),
                    positional=("beta", "temperature", "base_temperature"),
                    forward_options=("queue", "queue_labels"))
DCLLoss = _derived("DCLLoss", L.dcl_loss, lambda kw: (_x(2, 2), _x(2, 2).flip(0)), positional=("temperature",))
DCLWLoss = _derived("DCLWLoss", L.dclw_loss, lambda kw: (_x(2, 2), _x(2, 2).flip(0)), positional=("temperature",))
Qwen3EmbeddingLoss = _derived("Qwen3EmbeddingLoss", L.qwen3_embedding_loss, lambda kw: (_x(2, 2), _x(2, 2).flip(0)),
                              positional=("temperature",))
AMSoftmaxLoss = _derived("AMSoftmaxLoss", L.am_softmax_loss, lambda kw: (_x(2, 2), _x(2, 2).flip(0)),
                         positional=("margin", "temperature"))
CoSENTLoss = _derived("CoSENTLoss", cosent_loss, lambda kw: (_x(2, 2), _x(2, 2).flip(0), torch.tensor([0.0, 1.0])),
                      positional=("scale",))


class CLIPLoss(nn.Module):
    """CLIP loss with a learnable temperature: ``logit_scale`` (a parameter, initialised to
    ``log(1 / 0.07)``) is used as ``exp(logit_scale)``; ``forward(a, b, tau_plus=None)`` with a, b [N, D]. The
    Matryoshka keywords (``matryoshka_dims``, ``matryoshka_weights``, ``return_level_losses``),
    ``label_smoothing`` (default 0.0) and ``tau_plus`` (default 0.0; a float here, ``forward``'s ``tau_plus``
    overrides it for one call: a float or an [N] tensor of per-pair priors) are
    :func:`fused_contrastive.clip_loss`'s."""

    def __init__(self, init_temperature: float = 0.07, *, normalize: bool = True, reduction: str = "mean",
                 backend: str = "auto", gather=False, matryoshka_dims=None, matryoshka_weights=None,
                 return_level_losses: bool = False, label_smoothing: float = 0.0, tau_plus: float = 0.0):
        super().__init__()
        if isinstance(init_temperature, bool) or not (isinstance(init_temperature, (int, float))
                                                      and 0 < init_temperature < math.inf):
            raise ValueError(f"init_temperature must be a finite number > 0, got {init_temperature!r}")
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1.0 / init_temperature)))
        self.kw = dict(normalize=normalize, reduction=reduction, backend=backend, gather=gather,
                       label_smoothing=label_smoothing)
        if matryoshka_dims is not None or matryoshka_weights is not None or return_level_losses:
            self.kw.update(matryoshka_dims=matryoshka_dims, matryoshka_weights=matryoshka_weights,
                           return_level_losses=return_level_losses)
        if isinstance(tau_plus, Tensor):
            raise TypeError("tau_plus of CLIPLoss must be a float (pass a per-pair [N] tensor to forward)")
        self.tau_plus = V.tau_plus(tau_plus, 2, torch.device("cpu"))
        _gather_option(gather)
        V.backend(backend)
        _validated(L.clip_loss, _x(2, 2), _x(2, 2).flip(0), 1.0 / init_temperature, tau_plus=self.tau_plus, **self.kw)

    def forward(self, a: Tensor, b: Tensor, tau_plus: float | Tensor | None = None) -> Tensor:
        tau = self.tau_plus if tau_plus is None else tau_plus
        return L.clip_loss(a, b, self.logit_scale.exp(), tau_plus=tau, **self.kw)


class SigLIPLoss(nn.Module):
    """SigLIP loss with a learnable scale and bias (the paper's initialisation by default): ``logit_scale``
    (a parameter, initialised to ``log(init_scale)``) is used as ``exp(logit_scale)`` and ``logit_bias``
    (a parameter, initialised to ``init_bias``) as is; ``forward(image, text)`` with image, text [N, D]
    calls :func:`fused_contrastive.siglip_loss`."""

    def __init__(self, init_scale: float = 10.0, init_bias: float = -10.0, *, normalize: bool = True,
                 reduction: str = "mean", backend: str = "auto", gather=False):
        super().__init__()
        if isinstance(init_scale, bool) or not (isinstance(init_scale, (int, float)) and 0 < init_scale < math.inf):
            raise ValueError(f"init_scale must be a finite number > 0, got {init_scale!r}")
        if isinstance(init_bias, bool) or not (isinstance(init_bias, (int, float))
                                               and -math.inf < init_bias < math.inf):
            raise ValueError(f"init_bias must be a finite number, got {init_bias!r}")
        self.logit_scale = nn.Parameter(torch.tensor(math.log(init_scale)))
        self.logit_bias = nn.Parameter(torch.tensor(float(init_bias)))
        self.kw = dict(normalize=normalize, reduction=reduction, backend=backend, gather=gather)
        _gather_option(gather)
        V.backend(backend)
        _validated(siglip_loss, _x(2, 2), _x(2, 2).flip(0), float(init_scale), float(init_bias), **self.kw)

    def forward(self, image: Tensor, text: Tensor, image_groups: Tensor | None = None,
                text_groups: Tensor | None = None) -> Tensor:
        """``image_groups`` / ``text_groups``: :func:`fused_contrastive.siglip_loss`'s group positives."""
        return siglip_loss(image, text, self.logit_scale.exp(), self.logit_bias, image_groups=image_groups,
                           text_groups=text_groups, **self.kw)


class MaxSimInfoNCELoss(nn.Module):
    """:func:`fused_contrastive.maxsim.maxsim_info_nce` (late interaction, ColBERT's MaxSim, with in-batch
    negatives) holding its options; ``forward(query_tokens, doc_tokens, target=None, *, query_mask=None,
    doc_mask=None, negatives=None, negative_mask=None)`` with query_tokens [N, Lq, D], doc_tokens
    [M, Ld, D] and the masks [N, Lq] / [M, Ld] (the per-batch inputs). ``scale`` (default 1, PyLate's)
    or ``temperature``; ``learn_scale=True`` makes ``log(scale)`` a parameter; ``label_smoothing`` (default 0.0)
    is the function's."""

    def __init__(self, scale: float | None = None, *, temperature: float | None = None, learn_scale: bool = False,
                 length_normalize: bool = False, normalize: bool = True, reduction: str = "mean",
                 ignore_index: int = -100, backend: str = "auto", gather=False, label_smoothing: float = 0.0):
        super().__init__()
        s, _ = V.scale_of(temperature, scale, 1.0, torch.float64, torch.device("cpu"))
        V.flag("learn_scale", learn_scale)
        given = next(((k, v) for k, v in (("scale", scale), ("temperature", temperature)) if isinstance(v, Tensor)),
                     None)
        if given is not None and learn_scale:
            raise ValueError(f"learn_scale=True makes log(scale) a parameter of its own: give {given[0]} as a number "
                             f"with it, or a tensor (an nn.Parameter to learn it) without it")
        s = float(s.detach()) if isinstance(s, Tensor) else float(s)
        self.log_scale = nn.Parameter(torch.tensor(math.log(s))) if learn_scale else None
        self.scale = s
        # a tensor scale / temperature is kept (registered: a parameter when it is one, else a buffer) and
        # passed as given, so its gradient reaches it
        self._given = None
        if given is not None:
            self._given = given[0]
            if isinstance(given[1], nn.Parameter):
                self.register_parameter(f"given_{given[0]}", given[1])
            else:
                self.register_buffer(f"given_{given[0]}", given[1])
        self.kw = dict(length_normalize=length_normalize, normalize=normalize, reduction=reduction,
                       ignore_index=ignore_index, backend=backend, gather=gather, label_smoothing=label_smoothing)
        _gather_option(gather)
        V.backend(backend)
        _validated(maxsim_info_nce, _x(2, 2, 2), _x(2, 3, 2).flip(0), scale=self.scale, **self.kw)

    def forward(self, query_tokens: Tensor, doc_tokens: Tensor, target: Tensor | None = None, *,
                query_mask: Tensor | None = None, doc_mask: Tensor | None = None, negatives: Tensor | None = None,
                negative_mask: Tensor | None = None) -> Tensor:
        if self._given is not None:
            how = {self._given: getattr(self, f"given_{self._given}")}
        else:
            how = {"scale": self.log_scale.exp() if self.log_scale is not None else self.scale}
        return maxsim_info_nce(query_tokens, doc_tokens, target, query_mask=query_mask, doc_mask=doc_mask,
                               negatives=negatives, negative_mask=negative_mask, **how, **self.kw)


#: the hand-written modules (they hold learnable parameters or take per-batch masks), then every derived one
HAND_WRITTEN = ("CLIPLoss", "MaxSimInfoNCELoss", "SigLIPLoss")
__all__ = sorted([*HAND_WRITTEN, *(cls.__name__ for cls in DERIVED), "loss_module"])
