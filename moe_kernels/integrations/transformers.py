"""moe_kernels as a transformers experts implementation: ``experts_implementation="moe_kernels"``.

transformers (>= 5) runs the routed experts of its MoE models through one registry,
``ALL_EXPERTS_FUNCTIONS`` (transformers 5.24.0, ``src/transformers/integrations/moe.py``): an
experts class decorated with ``@use_experts_implementation`` looks its forward up there under
``config._experts_implementation`` and calls it as ``f(self, hidden_states, top_k_index,
top_k_weights)``. :func:`register` adds the name ``"moe_kernels"`` to that registry (and to the
fp8 experts' one, ``ALL_FP8_EXPERTS_FUNCTIONS`` in ``integrations/finegrained_fp8.py``); then::

    model = AutoModelForCausalLM.from_pretrained(path, experts_implementation="moe_kernels")
    model.set_experts_implementation("moe_kernels")     # or switch a model already loaded

runs every experts module through :func:`~moe_kernels.kernels.index_gather.fused_experts`.
:func:`enable` does the second after checking every experts module of the model.

The contract, and how it maps (line numbers of transformers 5.24.0's ``integrations/moe.py``
unless another file is named):

* the name: ``ExpertsInterface`` (540-565) is a ``GeneralInterface`` whose ``register`` adds to
  a class-wide mapping (``utils/generic.py``, 1244-1246); ``from_pretrained(...,
  experts_implementation=)`` and ``set_experts_implementation`` accept any name in it or in the
  fp8 one (``modeling_utils.py``, ``get_correct_experts_implementation``, 1893-1915), and the
  experts' forward looks it up at each call (``get_interface``, 550-562; the decorator, 631-634).
* the call (``grouped_mm_experts_forward``, 424-537): ``hidden_states [T, d]``,
  ``top_k_index [T, k]`` (0-based expert ids), ``top_k_weights [T, k]`` in; each token's
  weighted sum over its k experts, ``[T, d]`` in ``hidden_states``' dtype, out. That is
  :func:`fused_experts` itself.
* ``gate_up_proj [E, 2F, d]`` (gate rows, then up rows) and ``down_proj [E, d, F]``: the
  decorator's defaults ``is_concatenated=True, is_transposed=False`` (582-646; the example
  module, 47-48), used by Qwen3-MoE, DeepSeek-V3, Mixtral, OLMoE and most others. These are
  ``w1`` and ``w2`` exactly, passed as they are: no copy. The default gate
  (``_default_apply_gate``, 568-579) is ``act_fn(gate) * up`` on ``chunk(2)``: with a SiLU
  ``act_fn``, the SiLU-and-mul in GEMM 1's epilogue.
* ``is_transposed=True`` (Aria): ``[E, d, 2F]`` and ``[E, F, d]`` (``_grouped_linear``,
  386-421). The kernels read weight rows contiguous along K, so these are transposed into
  contiguous copies, once per module, and kept: one more copy of that module's expert weights.
* fp8 (``FP8Experts``, ``integrations/finegrained_fp8.py`` 713-872, its weights 771-783; what
  a fine-grained fp8 checkpoint such as DeepSeek-V3's loads into):
  ``float8_e4m3fn`` weights of the same shapes with float32 ``gate_up_proj_scale_inv`` /
  ``down_proj_scale_inv``, one per 128x128 block (real weight = fp8 x scale), and activations
  quantised on the fly (``activation_scheme="dynamic"``): DeepSeek-V3's format, this package's
  ``fp8-block``. The scales go in as ``w1_scale`` / ``w2_scale``.

Anything else is refused, never approximated: a ``NotImplementedError`` in the package's format
naming the module's attribute, raised by :func:`check_experts` (which :func:`enable` runs on
every experts module before switching), or else when the experts function first sees a module
(and again whenever one of its weights or flags changes). Refused: biases (``has_bias``),
interleaved gate/up (``is_concatenated=False``), ungated experts (``has_gate=False``), a norm
after each expert, an activation other than SiLU, a model's own gate function (``_apply_gate``:
GPT-OSS's clamped gate, softcaps), expert-parallel shards (``_is_expert_parallel``: their
sentinel ids), and fp8 weights in any other format (no scales, per-tensor or ``ue8m0`` scales,
fp4, static activation scales). The kernels have no backward, so a call that would need
gradients is refused as well: run the model under ``torch.no_grad()``, as ``generate`` does.

    >>> import pytest, torch
    >>> if not available():
    ...     pytest.skip("this transformers has no experts registry (transformers >= 5 has)")
    >>> from transformers import Qwen3MoeConfig
    >>> from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts
    >>> register()
    >>> config = Qwen3MoeConfig(hidden_size=32, moe_intermediate_size=16, num_experts=4,
    ...                         experts_implementation="eager")
    >>> experts = Qwen3MoeExperts(config)
    >>> g = torch.Generator().manual_seed(0)
    >>> with torch.no_grad():
    ...     _ = experts.gate_up_proj.copy_(torch.randn(4, 32, 32, generator=g) / 6)
    ...     _ = experts.down_proj.copy_(torch.randn(4, 32, 16, generator=g) / 4)
    >>> check_experts(experts)   # what the kernels will read: the parameters themselves
    ExpertsPlan(Qwen3MoeExperts: w1 = gate_up_proj [4, 32, 32], w2 = down_proj [4, 32, 16], unquantized)
    >>> x, ids = torch.randn(5, 32, generator=g), torch.tensor([[0, 3], [1, 2], [3, 2], [0, 1], [2, 0]])
    >>> weights = torch.rand(5, 2, generator=g)
    >>> with torch.no_grad():
    ...     eager = experts(x, ids, weights)
    ...     config._experts_implementation = "moe_kernels"
    ...     ours = experts(x, ids, weights)
    >>> bool(torch.linalg.norm(ours - eager) / torch.linalg.norm(eager) < 1e-5)
    True
    >>> experts.has_bias = True   # as if it were GPT-OSS's
    >>> check_experts(experts)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    NotImplementedError: check_experts: argument 'Qwen3MoeExperts.has_bias' must be False (...), got True
"""

from __future__ import annotations

import dataclasses
import weakref

import torch

from .._checks import FLOAT_DTYPES, fail

NAME = "moe_kernels"
_FUNC = "moe_kernels_experts"
#: The decorator's flags (``use_experts_implementation``), the value the kernels need and why.
_FLAGS = {"_is_expert_parallel": (False, "moe_kernels runs whole, unsharded experts: no expert-parallel sentinel ids"),
          "has_gate": (True, "moe_kernels runs gated experts only (gate_up_proj)"),
          "has_bias": (False, "moe_kernels runs experts without biases"),
          "has_post_expert_norm": (False, "moe_kernels applies no norm after each expert"),
          "is_concatenated": (True, "moe_kernels reads gate rows then up rows, not interleaved gate/up rows")}


def available() -> bool:
    """Whether the installed transformers has the experts registry (transformers >= 5)."""
    try:
        import transformers.integrations.moe as moe
    except ImportError:
        return False
    return hasattr(moe, "ALL_EXPERTS_FUNCTIONS")


def _registries():
    func = "register"
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    except ImportError as error:
        fail(func, "transformers", "must be installed, version 5 or later (it has the experts registry "
             "transformers.integrations.moe.ALL_EXPERTS_FUNCTIONS)", repr(str(error)), ImportError)
    registries = [ALL_EXPERTS_FUNCTIONS]
    try:   # fp8 experts (FP8Experts) look their forward up in a registry of their own
        from transformers.integrations.finegrained_fp8 import ALL_FP8_EXPERTS_FUNCTIONS
        registries.append(ALL_FP8_EXPERTS_FUNCTIONS)
    except ImportError:
        pass
    return registries


def register() -> None:
    """Make ``experts_implementation="moe_kernels"`` valid in this process (idempotent: a second
    call registers the same function again)."""
    for registry in _registries():
        # ``register`` is the class-wide mapping: every copy of the interface sees the name.
        registry.register(NAME, moe_kernels_experts)


# ----------------------------------------------------------------------------------------------
# Checking a module once: what the kernels will read
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, repr=False)
class ExpertsPlan:
    """An experts module's weights as :func:`fused_experts` reads them (see :func:`check_experts`)."""

    module: str
    w1: torch.Tensor
    w2: torch.Tensor
    w1_scale: torch.Tensor | None
    w2_scale: torch.Tensor | None
    format: str
    #: True where the weights are transposed copies (``is_transposed=True`` modules).
    copied: bool

    def __repr__(self) -> str:
        source = "transposed copies of " if self.copied else ""
        return (f"ExpertsPlan({self.module}: w1 = {source}gate_up_proj {list(self.w1.shape)}, w2 = down_proj "
                f"{list(self.w2.shape)}, {self.format})")


# module -> (key, plan). Weak, so that a module's cached plan (and a transposed copy) goes with it.
_PLANS: "weakref.WeakKeyDictionary[torch.nn.Module, tuple]" = weakref.WeakKeyDictionary()
_SCALES = ("gate_up_proj_scale_inv", "down_proj_scale_inv")


def _tensor_key(t):
    if not isinstance(t, torch.Tensor):
        return t
    # A parameter replaced, moved, reassigned (``p.data = ...``) or changed in place under
    # ``torch.no_grad()`` (``copy_``, ``load_state_dict``) changes its address or its version.
    # In-place changes through ``p.data`` bump no version (they are hidden from autograd too):
    # after one, call check_experts(module) to refresh a transposed copy.
    return t.data_ptr(), t._version, t.dtype, t.device, tuple(t.shape)


_MISSING = object()
_KEY_FLAGS = (*_FLAGS, "is_transposed", "block_size", "activation_scheme")


def _attribute(module, name):
    """``getattr(module, name, None)``, without its slow path: an attribute a module lacks (most of
    the fp8 flags on a bf16 module) costs ``nn.Module.__getattr__`` a raised AttributeError, about a
    microsecond each, at every layer of every step. Same answer: a data descriptor of the class
    (a property) first, then the instance's dict, its parameters, buffers and submodules, then the
    class attribute (bound through ``getattr`` when it is a method or another descriptor)."""
    on_class = getattr(type(module), name, _MISSING)
    if on_class is not _MISSING and hasattr(type(on_class), "__set__"):   # a property: computed
        return getattr(module, name, None)
    attrs = module.__dict__
    value = attrs.get(name, _MISSING)
    if value is not _MISSING:
        return value
    for store in ("_parameters", "_buffers", "_modules"):
        values = attrs.get(store)
        if values and name in values:
            return values[name]
    if on_class is _MISSING:
        return None
    return getattr(module, name, None) if hasattr(type(on_class), "__get__") else on_class


def _plan_key(module) -> tuple:
    gate = _attribute(module, "_apply_gate")
    act = _attribute(module, "act_fn")
    flags = tuple(_attribute(module, name) for name in _KEY_FLAGS)
    tensors = tuple(_tensor_key(_attribute(module, name)) for name in ("gate_up_proj", "down_proj", *_SCALES))
    return flags, getattr(gate, "__func__", gate), type(act), id(act), tensors


def _is_default_gate(module) -> bool:
    """The module's gate is ``act_fn(gate) * up`` on ``chunk(2)``: transformers' default, or
    ``FP8Experts``' with none of its clamps and softcaps configured."""
    from transformers.integrations.moe import _default_apply_gate

    gate = getattr(module, "_apply_gate", None)
    func = getattr(gate, "__func__", gate)
    if func is _default_apply_gate:
        return True
    try:
        from transformers.integrations.finegrained_fp8 import FP8Experts
    except ImportError:
        return False
    extras = ("gate_softcap", "up_softcap", "swiglu_alpha", "swiglu_limit", "limit")
    return func is FP8Experts._apply_gate and all(getattr(module, name, None) is None for name in extras)


def _is_silu(act) -> bool:
    from transformers.activations import SiLUActivation

    return isinstance(act, (SiLUActivation, torch.nn.SiLU)) or act is torch.nn.functional.silu


def _build_plan(func: str, module) -> ExpertsPlan:
    cls = type(module).__name__

    def refuse(attr, expected, got):
        fail(func, f"{cls}.{attr}", expected, got, NotImplementedError)

    if not isinstance(module, torch.nn.Module):
        fail(func, "module", "must be a transformers experts module (a torch.nn.Module)", type(module).__name__,
             TypeError)
    for attr, (wanted, why) in _FLAGS.items():
        if getattr(module, attr, wanted) != wanted:
            refuse(attr, f"must be {wanted} ({why})", getattr(module, attr))
    if not _is_default_gate(module):
        refuse("_apply_gate", "must be transformers' default gate act_fn(gate) * up (moe_kernels computes "
               "silu(gate) * up; this module's own gate function may clamp, softcap or interleave)",
               getattr(getattr(module, "_apply_gate", None), "__qualname__", None))
    act = getattr(module, "act_fn", None)
    if not _is_silu(act):
        refuse("act_fn", "must be SiLU (moe_kernels computes silu(gate) * up)", type(act).__name__)

    w1, w2 = (getattr(module, name, None) for name in ("gate_up_proj", "down_proj"))
    for name, w in (("gate_up_proj", w1), ("down_proj", w2)):
        if not isinstance(w, torch.Tensor) or w.dim() != 3:
            fail(func, f"{cls}.{name}", "must be a 3-D tensor [E, N, K] of expert weights",
                 type(w).__name__ if not isinstance(w, torch.Tensor) else f"shape {tuple(w.shape)}")
        if type(w.data) is not torch.Tensor:   # a DTensor, a quantised tensor subclass
            refuse(name, "must hold a plain torch.Tensor", type(w.data).__name__)
    fp8 = w1.dtype == torch.float8_e4m3fn
    scales = tuple(getattr(module, name, None) for name in _SCALES) if fp8 else (None, None)
    transposed = bool(getattr(module, "is_transposed", False))
    if fp8:
        _check_fp8(refuse, module, scales, transposed)
    elif w1.dtype not in FLOAT_DTYPES:
        want = " or ".join(str(d).replace("torch.", "") for d in (*FLOAT_DTYPES, torch.float8_e4m3fn))
        refuse("gate_up_proj", f"must have dtype {want}", str(w1.dtype).replace("torch.", ""))
    if w2.dtype != w1.dtype:
        refuse("down_proj", f"must have gate_up_proj's dtype {str(w1.dtype).replace('torch.', '')}",
               str(w2.dtype).replace("torch.", ""))
    if transposed:
        # The kernels read each weight row contiguous along K (stride 1), and [E, d, 2F] read
        # as [E, 2F, d] has stride 2F there: one contiguous transposed copy, made here, once per
        # module and weight version, and kept with the plan (the memory of that module's expert
        # weights once more; never a copy per call).
        w1, w2 = w1.detach().transpose(1, 2).contiguous(), w2.detach().transpose(1, 2).contiguous()
    e, two_f, d = w1.shape
    if two_f % 2 or tuple(w2.shape) != (e, d, two_f // 2):
        layout = "[E, d, 2F] and [E, F, d]" if transposed else "[E, 2F, d] and [E, d, F]"
        refuse("down_proj", f"must match gate_up_proj {list(getattr(module, 'gate_up_proj').shape)} as {layout}",
               f"shape {tuple(getattr(module, 'down_proj').shape)}")
    fmt = _weight_format(func, cls, w1, w2, scales)
    return ExpertsPlan(cls, w1, w2, *scales, fmt, transposed)


def _check_fp8(refuse, module, scales, transposed) -> None:
    """fp8 weights run in one format: float32 128x128 block scales, activations quantised on the fly."""
    for name, scale in zip(_SCALES, scales):
        if scale is None:
            refuse(name, "must hold the fp8 weights' float32 128x128 block scales "
                   "(fp8 weights without them are in a format moe_kernels does not read)", None)
    block = getattr(module, "block_size", None)
    if block is None or tuple(block) != (128, 128):
        refuse("block_size", "must be (128, 128) (moe_kernels reads fp8 weights with DeepSeek-V3's 128x128 block "
               "scales only)", block)
    scheme = getattr(module, "activation_scheme", "dynamic")
    if scheme != "dynamic":
        refuse("activation_scheme", "must be 'dynamic' (moe_kernels quantises activations per token, 1x128)",
               repr(scheme))
    if transposed:
        refuse("is_transposed", "must be False for fp8 weights", True)


def _weight_format(func, cls, w1, w2, scales) -> str:
    """The weights' :class:`~moe_kernels.kernels.formats.WeightFormat` name, checked as
    :func:`fused_experts` checks it, the errors naming the module's attributes."""
    from ..kernels.formats import WeightFormat

    names = [(f"{cls}.{w}", f"{cls}.{s}") for w, s in (("gate_up_proj", _SCALES[0]), ("down_proj", _SCALES[1]))]
    fmt = WeightFormat.of(func, names[0][0], w1, scales[0], names[0][1])
    other = WeightFormat.of(func, names[1][0], w2, scales[1], names[1][1])
    if other is not fmt:
        fail(func, names[1][1] if fmt.quantized else names[1][0], f"must be in gate_up_proj's format ({fmt.name})",
             other.name)
    if fmt.quantized and fmt.name != "fp8-block":
        fail(func, names[0][1], "must be 128x128 block scales", fmt.name, NotImplementedError)
    fmt.check_gated(func, names[0][0], w1)
    return fmt.name


def check_experts(module, *, func: str = "check_experts") -> ExpertsPlan:
    """Check that ``module`` (an experts module of a transformers model) is one the kernels run,
    and return what they will read (kept per module until a weight or flag changes). Raises a
    ``NotImplementedError`` naming the first attribute that is not (a ``TypeError`` for an fp8
    scale tensor of another dtype than float32)."""
    key = _plan_key(module)
    cached = _PLANS.get(module)
    if cached is not None and cached[0] == key:
        return cached[1]
    plan = _build_plan(func, module)
    _PLANS[module] = (key, plan)
    return plan


def _experts_modules(model):
    """The experts modules of ``model``: those ``@use_experts_implementation`` set up (the flags
    every release since 5.0 sets; ``_is_expert_parallel`` came later, 5.17 has none)."""
    flags = ("has_gate", "is_transposed", "is_concatenated")
    return [m for m in model.modules() if all(hasattr(m, flag) for flag in flags)]


def enable(model):
    """Register, check every experts module of ``model`` (:func:`check_experts`: a module the
    kernels cannot run fails here, not in the middle of a forward), then
    ``model.set_experts_implementation("moe_kernels")``. Returns ``model``."""
    func = "enable"
    register()
    modules = _experts_modules(model)
    if not modules:
        fail(func, "model", "must hold experts modules that go through transformers' experts registry "
             "(@use_experts_implementation)", type(model).__name__)
    for module in modules:
        check_experts(module, func=func)
    model.set_experts_implementation(NAME)
    return model


# ----------------------------------------------------------------------------------------------
# The experts function transformers calls
# ----------------------------------------------------------------------------------------------


def moe_kernels_experts(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                        top_k_weights: torch.Tensor) -> torch.Tensor:
    """``experts_implementation="moe_kernels"``: transformers' experts call (see the module
    docstring) through :func:`~moe_kernels.kernels.index_gather.fused_experts`."""
    from ..kernels.index_gather import fused_experts

    plan = check_experts(self, func=_FUNC)
    if torch.is_grad_enabled():
        weights = [(f"{plan.module}.{name}", getattr(self, name)) for name in ("gate_up_proj", "down_proj")]
        for name, t in [("hidden_states", hidden_states), ("top_k_weights", top_k_weights), *weights]:
            if t.requires_grad:
                fail(_FUNC, name, "must not need gradients (the kernels have no backward: run the model under "
                     "torch.no_grad() or torch.inference_mode(), or requires_grad_(False) its weights)",
                     "requires_grad=True", NotImplementedError)
    x = hidden_states if plan.w1_scale is not None else hidden_states.to(plan.w1.dtype)
    out = fused_experts(x, plan.w1, plan.w2, top_k_weights.contiguous(), top_k_index,
                        w1_scale=plan.w1_scale, w2_scale=plan.w2_scale)
    return out.to(hidden_states.dtype)
