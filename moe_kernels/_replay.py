"""Replaying a call: the host work of a repeated call done once, its launches kept as a list.

(Over 400 lines, and kept whole: the recording, the plan it makes and the replay are one
mechanism, each half meaningless without the other.)

At decode one MoE layer costs the GPU 30-300 microseconds and its Python as much or more: checks,
format and config lookups, block-map sizes, a dozen ``torch.empty``, and per Triton kernel a key,
a dict and the launch. All of it depends only on what the arguments *are* (shapes, strides,
dtypes, devices, 16-byte alignment, options), never on their values. So the second call of a
signature is recorded and later ones replay it:

* every torch operation (below autograd, through a ``TorchDispatchMode``), each tensor argument
  named by its origin: an input, an earlier operation's output, or a constant (a tensor from
  outside the call, kept by reference: a layer's weights);
* every Triton launch (compiled kernel, grid, arguments), each pointer as (the tensor whose
  memory it points into, byte offset); a replay calls the launcher with integer pointers.

A replay redoes only the operations whose results are used (a view that only fed a launch is
not: the launch gets its pointer by offset; a view of constants only is made once), each through
torch's Python binding of the same name where that reaches the same overload (``torch.empty`` in
place of ``torch.ops.aten.empty.memory_format``: a third of the host time), gives the buffers
only launches touch one workspace allocation, and runs every launch in order on the current
stream, a TMA descriptor rebuilt on its base's new address. It is the recorded call on new
inputs because the key holds all the call's Python reads (each tensor's shape, strides, dtype,
device and address mod 16, the other arguments, the current device, Triton's debug knob; a
layer forgets its plans when its weights or rules change, new tuned tables forget all), and a
call that might depend on *values* is not recorded: an operation that reads values back
(``.item()``, a copy to the host) or has a data-dependent shape (``nonzero``, a mask index), a
launch through Triton's own path (a new binary), inputs that share memory,
or one that requires grad. Such a signature runs eagerly after :data:`MAX_REFUSALS` tries.
Outputs are fresh at every replay (two streams or threads can replay one plan); a CUDA-graph
capture, a launch hook or a launch trace runs eagerly. ``MOE_KERNELS_REPLAY=0`` turns it off.
Once a plan has replayed once on a set of weights, :mod:`moe_kernels._replay_graphs` captures
the replay into a CUDA graph at the next call, and later calls launch that (the activations
copied in, the weights read in place, the output copied out): a decode call's host work becomes
a handful of API calls. A stretch of the call marked by :func:`~moe_kernels._replay_fork.side_stream_stretch` (a
layer's shared expert) runs, in that capture only, on a side stream (:mod:`moe_kernels._replay_fork`).
Use (on a GPU): ``plans.run(tensors, options, lambda: eager(...))``.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ._replay_fork import Fork, Slot as _Slot, slots_in as _slots_in, with_join
from ._replay_graphs import PlanGraphs


_Tensor = torch.Tensor
#: Refused recordings of one signature before it is left to run eagerly for good.
MAX_REFUSALS = 3
#: Plans kept per entry point before its cache is emptied (a server whose prefills all have new
#: lengths records each length at its second call; the cache must stay bounded).
MAX_PLANS = 512
ENABLED = os.environ.get("MOE_KERNELS_REPLAY", "1") != "0"

_local = threading.local()   # .recording: the Recording of this thread's call, if any
_all_plans = weakref.WeakSet()   # every CallPlans, so that new tuned tables can empty them all


class Refused(Exception):
    """Something in the recorded call that a replay could not reproduce (the reason)."""


def recording_now():
    """The :class:`Recording` this thread is making, or None."""
    return getattr(_local, "recording", None)


def forget_all_plans() -> None:
    """Empty every plan cache (new tuned tables: a plan's baked-in configs may be stale)."""
    for plans in list(_all_plans):   # (a copy: another thread may be building a layer)
        plans.clear()


def tensor_signature(t):
    """What of a tensor argument the call's Python and Triton's binaries can depend on (None
    stays None: an optional argument left out)."""
    if t is None:
        return None
    return t.shape, t.stride(), t.dtype, t.device, t.data_ptr() & 15


class Recording:
    """One call being recorded: its tensors numbered as slots (inputs first), the operations and
    launches in order."""

    def __init__(self, inputs):
        self.num_inputs = len(inputs)
        self.tensors = []        # slot -> the tensor (kept alive, so that no id() is reused)
        self.slot_of = {}        # id(tensor) -> slot
        self.root_of = {}        # storage address -> the slot that owns the memory
        self.constants = []      # slots of tensors from outside the call
        self.aliases = []        # tensors that share a slot with another
        self.events = []         # ("op", func, args, kwargs, outs, many), ("launch", compiled, grid, device,
                                 # args, pointers) or ("mark", kind): _replay_fork's side-stream stretch
        self.refusal = None
        self.device = inputs[0].device if inputs and isinstance(inputs[0], _Tensor) else None
        for t in inputs:
            if t is not None and self._storage(t) in self.root_of:
                self.refusal = "two inputs share memory"
            self._add(t)

    @staticmethod
    def _storage(t):
        return t.untyped_storage().data_ptr()

    def _add(self, t) -> int:
        slot = len(self.tensors)
        self.tensors.append(t)
        if t is not None:
            self.slot_of[id(t)] = slot
            self.root_of.setdefault(self._storage(t), slot)
        return slot

    def slot(self, t) -> int:
        """The slot of ``t``; a tensor first seen here comes from outside the call: a constant."""
        slot = self.slot_of.get(id(t))
        if slot is None:
            if self.root_of.get(self._storage(t), self.num_inputs) < self.num_inputs:
                # e.g. an input that is a view of a layer's weight: a replay would read the new input
                self.refuse("an input shares memory with a tensor from outside the call")
            slot = self._add(t)
            self.constants.append(slot)
        return slot

    def refuse(self, why: str) -> None:
        if self.refusal is None:
            self.refusal = why

    # -- operations ---------------------------------------------------------------------------

    def _template(self, value):
        if isinstance(value, _Tensor):
            return _Slot(self.slot(value))
        if isinstance(value, (list, tuple)):   # e.g. aten.cat's list of tensors
            return type(value)(self._template(v) for v in value)
        return value

    def note_op(self, func, args, kwargs, out) -> None:
        tags = getattr(func, "tags", ())
        if func is torch.ops.aten.index.Tensor:   # integer indices: the result's shape is theirs
            dynamic = any(isinstance(i, _Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1])
        else:
            dynamic = torch.Tag.dynamic_output_shape in tags or torch.Tag.data_dependent_output in tags
        if func is torch.ops.aten._local_scalar_dense.default or dynamic:
            self.refuse(f"{func} reads values back to the host")
        results = out if isinstance(out, (tuple, list)) else (out,)
        for t in results:
            if isinstance(t, _Tensor) and t.device != self.device:   # e.g. a copy to the host
                self.refuse(f"{func} makes a tensor on {t.device}")
        if func in _SAME_TENSOR and isinstance(args[0], _Tensor) and isinstance(out, _Tensor):
            # The same memory and geometry under another tensor object (a factory function's
            # result is detached once under the mode): one slot for both, nothing to redo.
            self.slot_of[id(out)] = self.slot(args[0])
            self.aliases.append(out)   # kept alive, so that its id() is not reused
            return
        args_t, kwargs_t = self._template(args), {k: self._template(v) for k, v in kwargs.items()}
        outs = []
        for t in results:
            if not isinstance(t, _Tensor):
                outs.append(None)
            elif id(t) in self.slot_of:   # an in-place operation returns its input
                outs.append(self.slot_of[id(t)])
            else:
                outs.append(self._add(t))
        self.events.append(("op", func, args_t, kwargs_t, tuple(outs), isinstance(out, (tuple, list))))

    # -- launches -----------------------------------------------------------------------------

    def note_launch(self, compiled, grid, device, values) -> None:
        args, pointers = [], []
        for position, v in enumerate(values):
            descriptor = None
            if not isinstance(v, _Tensor) and hasattr(v, "block_shape"):   # a TMA descriptor: its base, by slot
                # and offset, and every other field as it was (what the launcher encodes from it per launch;
                # Triton 3.9 reads one more field than 3.6, round_f32_to_tf32)
                descriptor, v = _descriptor_fields(v), v.base
            if isinstance(v, _Tensor):
                if self._storage(v) == 0:   # empty tensors all sit at address 0: no owner to find
                    self.refuse("a launch reads an empty tensor")
                root = self.root_of.get(self._storage(v))
                if root is None:
                    root = self.slot(v)
                pointers.append((position, root, v.data_ptr() - self.tensors[root].data_ptr(), descriptor))
                args.append(None)
            else:
                args.append(v)
        grid = (grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1)
        self.events.append(("launch", compiled, grid, device, args, tuple(pointers)))

    # -- the plan -----------------------------------------------------------------------------

    def plan(self, result) -> "Plan":
        """The :class:`Plan` that replays this call, whose result was ``result``."""
        if self.refusal is not None:
            raise Refused(self.refusal)
        many = isinstance(result, (tuple, list))
        returned = []
        for t in (result if many else (result,)):
            slot = self.slot_of.get(id(t)) if isinstance(t, _Tensor) else None
            if slot is None or slot in self.constants:
                raise Refused("the result is not made by the call")
            returned.append(slot)
        # A view of constants only (the transposed gate of ``x @ gate.t()``) is a constant too:
        # the same memory whatever the inputs, so it is made once, here, not at every replay
        # (unless it is returned: each call must return its own tensor object).
        constant, events = set(self.constants), []
        for event in self.events:
            if event[0] == "op" and _is_view(event[1]) and set(_slots_in((event[2], event[3]))) <= constant \
                    and None not in event[4] and not set(event[4]) & set(returned):
                constant.update(event[4])
                self.constants.extend(event[4])
            else:
                events.append(event)
        # Keep what the result needs, walking back: every launch, every operation that writes
        # (in place), and the operations whose outputs a kept event reads.
        needed, kept = set(returned), []
        for event in reversed(events):
            if event[0] == "mark":
                kept.append(event)
                continue
            if event[0] == "launch":
                needed.update(pointer[1] for pointer in event[5])
                kept.append(event)
                continue
            _, func, args_t, kwargs_t, outs, _ = event
            writes = any(a.alias_info is not None and a.alias_info.is_write for a in func._schema.arguments)
            if writes or not func._schema.returns or any(o in needed for o in outs if o is not None):
                needed.update(_slots_in((args_t, kwargs_t)))
                kept.append(event)
        kept = with_join(kept[::-1], frozenset((*range(self.num_inputs), *constant)))
        # Buffers that only launches touch (no operation reads them, none is returned) become
        # pieces of one workspace: one allocation per replay instead of one each. Each piece
        # starts on a 512-byte boundary, as the caching allocator's blocks do, so every pointer
        # keeps the alignment Triton specialised on.
        read = set(returned)
        for event in kept:
            if event[0] == "op":
                read.update(_slots_in((event[2], event[3])))
        workspace, pieces, size = len(self.tensors), {}, 0
        for event in kept:
            if event[0] == "op" and event[1] in _ALLOCATIONS and event[4][0] not in read:
                pieces[event[4][0]] = size
                size += -(-self.tensors[event[4][0]].untyped_storage().nbytes() // 512) * 512
        kept = [event for event in kept if not (event[0] == "op" and event[1] in _ALLOCATIONS
                                                and event[4][0] in pieces)]
        kept = [event if event[0] == "mark" else (*event, self._binding(event)) if event[0] == "op" else
                (*event[:5], tuple((position, workspace, pieces[root] + offset, descriptor) if root in pieces
                                   else (position, root, offset, descriptor)
                                   for position, root, offset, descriptor in event[5]))
                for event in kept]
        constants = tuple((slot, self.tensors[slot], self.tensors[slot].data_ptr(), self.tensors[slot].shape)
                          for slot in self.constants)
        # What a CUDA graph of the plan would hold (moe_kernels._replay_graphs): the memory the
        # call made, each storage once (a view is not more memory; a view of a weight is none).
        outside = {self._storage(self.tensors[slot]) for slot in (*range(self.num_inputs), *self.constants)
                   if self.tensors[slot] is not None}
        made = {self._storage(t): t.untyped_storage().nbytes() for slot, t in enumerate(self.tensors)
                if slot >= self.num_inputs and t is not None and self._storage(t) not in outside}
        plan = Plan(self.num_inputs, len(self.tensors), constants, kept, tuple(returned), many,
                    (size, self.device) if size else None, sum(made.values()))
        plan.output_specs = tuple((tuple(self.tensors[slot].shape), self.tensors[slot].stride(),
                                   self.tensors[slot].dtype) for slot in returned)
        plan.returns_input_memory = any(self._storage(self.tensors[slot]) in outside for slot in returned)
        return plan


    def _binding(self, event):
        """The quickest way to call an operation again: torch's Python binding of the same name
        (``torch.mm``, ``torch.empty``, ``Tensor.view``: argument parsing in generated C++) when,
        called with the recorded arguments, it dispatches to exactly the recorded overload, else
        the overload itself (``torch.ops.aten.slice.Tensor``: a schema-driven boxed call, 1.5-3x
        the host time, the most for factories with keyword arguments). Checked by calling the
        binding under a mode that stops it at its first dispatch, so nothing runs."""
        _, func, args_t, kwargs_t, _, _ = event
        name = func._schema.name.partition("::")[2]
        args, kwargs = _filled(args_t, self.tensors), {k: _filled(v, self.tensors) for k, v in kwargs_t.items()}
        for namespace in (torch._C._VariableFunctions, torch._C._nn, _Tensor):
            binding = getattr(namespace, name, None)
            if binding is None or (namespace is _Tensor and not (args and isinstance(args[0], _Tensor))):
                continue
            try:
                with _FirstDispatch():
                    binding(*args, **kwargs)
            except _Dispatched as hit:
                if hit.func is func:
                    return binding
            except Exception:   # (another signature: this binding is not the operation's)
                pass
        return func._op


class _Dispatched(Exception):
    def __init__(self, func):
        super().__init__(str(func))
        self.func = func


class _FirstDispatch(TorchDispatchMode):
    """Stops a call at its first operation below autograd and names it (nothing runs)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        raise _Dispatched(func)


def _is_view(func) -> bool:
    """An operation whose result is a view of an input (it writes nothing)."""
    returns = func._schema.returns
    return (len(returns) == 1 and returns[0].alias_info is not None and not returns[0].alias_info.is_write
            and not any(a.alias_info is not None and a.alias_info.is_write for a in func._schema.arguments))


_ALLOCATIONS = (torch.ops.aten.empty.memory_format,)
_SAME_TENSOR = (torch.ops.aten.detach.default, torch.ops.aten.alias.default)


def _descriptor_fields(desc) -> dict:
    """A TMA descriptor's fields other than its base (a dataclass in Triton 3.6 and 3.9)."""
    if dataclasses.is_dataclass(desc):
        return {f.name: getattr(desc, f.name) for f in dataclasses.fields(desc) if f.name != "base"}
    return {name: getattr(desc, name) for name in ("shape", "strides", "block_shape", "padding")}


class _Address(int):
    """An address that answers ``data_ptr()``, as the base of a replayed descriptor must."""

    def data_ptr(self) -> int:
        return int(self)


class _Descriptor:
    """A TMA ``TensorDescriptor`` on a new base address, with the recorded descriptor's other
    fields (shape, strides, box, padding, ...): what Triton's launcher reads to encode the hardware
    descriptor at every launch."""

    def __init__(self, address, fields: dict):
        self.__dict__.update(fields)
        self.base = _Address(address)


def _filled(template, slots):
    if isinstance(template, _Slot):
        return slots[template]
    if isinstance(template, (list, tuple)):
        return type(template)(_filled(v, slots) for v in template)
    return template


class _Recorder(TorchDispatchMode):
    """Notes every torch operation of the call being recorded (below autograd)."""

    def __init__(self, recording: Recording):
        super().__init__()
        self.recording = recording

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.recording.note_op(func, args, kwargs, out)
        return out


class Plan:
    """A recorded call, replayed on new inputs of the same signature (see the module docstring)."""

    def __init__(self, num_inputs, num_slots, constants, events, returned, many, workspace=None, graph_bytes=0):
        self.num_inputs, self.num_slots, self.returned, self.many = num_inputs, num_slots, returned, many
        self.constants = constants
        self.graph_bytes = graph_bytes
        self.output_specs = ()   # (shape, strides, dtype) of each result (set by Recording.plan)
        self.returns_input_memory = False
        #: its CUDA graphs (moe_kernels._replay_graphs.PlanGraphs), set by CallPlans on a GPU
        self.graphs = None
        #: (bytes, device) of the one buffer that holds every launch-only buffer (slot num_slots)
        self.workspace = workspace
        self.replays = 0
        self.steps = []
        for event in events:
            if event[0] == "mark":   # (None: neither a launch nor an operation)
                self.steps.append((None, event[1]))
            elif event[0] == "launch":
                _, compiled, grid, device, args, pointers = event
                self.steps.append((True, compiled.run, grid, device, compiled.function, compiled.packed_metadata,
                                   args, pointers))
            else:
                _, func, args_t, kwargs_t, outs, many_out, binding = event
                # flat: no list of tensors among the arguments; kwargs without tensors are passed as they are
                flat = not any(isinstance(a, (list, tuple)) for a in args_t)
                fixed = not any(True for _ in _slots_in(kwargs_t))
                self.steps.append((False, binding, args_t, kwargs_t, outs, many_out, flat, fixed, func))
        self.num_launches = sum(1 for s in self.steps if s[0])
        self.num_ops = sum(1 for s in self.steps if s[0] is False)
        #: a stretch a capture runs on a side stream (replay's ``fork``)
        self.forks = any(s[0] is None for s in self.steps)

    def operations(self) -> list[str]:
        """The torch operations a replay redoes, by overload name (``aten.mm.default``)."""
        return [str(step[8]) for step in self.steps if step[0] is False]

    def replay(self, inputs, fork: torch.cuda.Stream | None = None):
        """The call on ``inputs``; with ``fork`` (a side stream, given while a CUDA graph is captured), its marked
        stretch on that stream."""
        if fork is None or not self.forks:
            return self._replay(inputs, None)
        forked = Fork(fork)
        try:
            return self._replay(inputs, forked)
        finally:
            forked.close()

    def _replay(self, inputs, forked):
        slots = [*inputs, *([None] * (self.num_slots - self.num_inputs))]
        for slot, tensor, _, _ in self.constants:
            slots[slot] = tensor
        if self.workspace is not None:
            slots.append(torch.empty(self.workspace[0], dtype=torch.uint8, device=self.workspace[1]))
        stream = None
        for step in self.steps:
            if step[0]:
                _, run, grid, device, function, metadata, args, pointers = step
                if stream is None:
                    stream = torch._C._cuda_getCurrentRawStream(device)
                args = args.copy()
                for position, slot, offset, descriptor in pointers:
                    address = slots[slot].data_ptr() + offset
                    args[position] = address if descriptor is None else _Descriptor(address, descriptor)
                run(grid[0], grid[1], grid[2], stream, function, metadata, None, None, None, *args)
            elif step[0] is None:   # a mark: the side stream's fork, end or join, acted on only with one
                if forked is not None:
                    forked.step(step[1])
                    stream = None   # (the next launch goes to the stream now current)
            else:
                _, func, args_t, kwargs_t, outs, many_out, flat, fixed, _ = step
                args = [slots[a] if type(a) is _Slot else a for a in args_t] if flat else _filled(args_t, slots)
                out = func(*args, **(kwargs_t if fixed else {k: _filled(v, slots) for k, v in kwargs_t.items()}))
                if many_out:
                    for slot, t in zip(outs, out):
                        if slot is not None:
                            slots[slot] = t
                elif outs[0] is not None:
                    slots[outs[0]] = out
        self.replays += 1
        if self.many:
            return tuple(slots[s] for s in self.returned)
        return slots[self.returned[0]]


class CallPlans:
    """The plans of one entry point, by signature key; a signature is recorded at its second call."""

    def __init__(self, name: str, pinned: tuple = ()):
        self.name = name
        #: the inputs a CUDA graph of a plan reads in place (the weights: moe_kernels._replay_graphs);
        #: the others it copies into static buffers
        self.pinned = pinned
        self.plans = {}
        self.calls = {}       # key -> eager calls so far (recording starts at the second)
        self.last_refusal = None
        _all_plans.add(self)

    def clear(self) -> None:
        self.plans.clear()
        self.calls.clear()

    def __getstate__(self):   # a pickled layer keeps no plans (aten ops and launchers do not pickle)
        return {"name": self.name, "pinned": self.pinned}

    def __setstate__(self, state):
        self.__init__(state["name"], state.get("pinned", ()))

    def key(self, tensors, options):
        """The signature key of a call on ``tensors`` (a tuple, None for an optional one left out)
        with ``options`` (a hashable tuple), or None when this call must run eagerly."""
        if not ENABLED or getattr(_local, "recording", None) is not None:
            return None
        try:
            if not tensors[0].is_cuda or _eager_only():
                return None
            if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
                return None
            key = (tuple(map(tensor_signature, tensors)), tuple(map(options_key, options)),
                   torch._C._cuda_getDevice(), _runtime_knobs.debug,
                   getattr(_compilation_knobs, "instrumentation_mode", None),
                   getattr(_compilation_knobs, "fpsan_homomorphic_casts", None))
            hash(key)
        except (AttributeError, TypeError, RuntimeError):   # not tensors (a sparse one has no data_ptr), odd
            return None                                     # options: the eager path says what is wrong
        return key

    def get(self, key):
        """The plan of ``key`` (None: record or run eagerly). A plan whose constants moved or
        changed shape (a weight's ``.data`` replaced, which no ``__setattr__`` sees) is forgotten."""
        plan = None if key is None else self.plans.get(key)
        if plan is not None and any(t.data_ptr() != ptr or t.shape != shape for _, t, ptr, shape in plan.constants):
            del self.plans[key]
            self.calls.pop(key, None)
            return None
        return plan

    def run(self, tensors, options, eager):
        """The call on ``tensors`` with ``options``: replayed if its signature has a plan, else
        ``eager()`` (recorded at the signature's second call)."""
        key = self.key(tensors, options)
        plan = self.get(key)
        if plan is None:
            return self.call(key, tensors, eager)
        if plan.graphs is not None:   # one CUDA graph launch, once a plan has replayed on these weights
            result = plan.graphs(plan, tensors)
            if result is not None:
                return result
        return plan.replay(tensors)

    def call(self, key, tensors, eager):
        """Run ``eager()`` (the call's own path); record it if this is the signature's second call."""
        if key is None:
            return eager()
        seen = self.calls.get(key, 0)
        if len(self.calls) >= 4 * MAX_PLANS:   # (many signatures seen once: keep the count bounded)
            self.calls.clear()
        self.calls[key] = seen + 1
        if seen == 0 or seen > MAX_REFUSALS:
            return eager()
        recording = Recording(tensors)
        _local.recording = recording
        try:
            with _Recorder(recording):
                result = eager()
        finally:
            _local.recording = None
        try:
            plan = recording.plan(result)
        except Refused as why:
            self.last_refusal = str(why)
            return result
        if len(self.plans) >= MAX_PLANS:
            self.clear()
        if recording.device is not None and recording.device.type == "cuda":
            plan.graphs = PlanGraphs(plan, self.pinned)
        self.plans[key] = plan
        return result


_runtime_knobs = _compilation_knobs = None   # triton.knobs.runtime and .compilation, looked up once


def options_key(value):
    """An option in a key: its type with its value (``64`` and ``64.0``, ``True`` and ``1`` are
    equal in Python, but the eager path accepts only one of each); an object such as a config by
    identity (kept alive by the key, so that the id cannot be reused), since an equal object with
    fields of the wrong type must reach the eager path's checks."""
    if value is None or type(value) in (bool, int, str):
        return type(value), value
    return type(value), id(value), value
eager_calls = 0   # above 0 (inside _runtime.record_launches, whose trace a replay would skip): eager


def no_hooks(hook) -> bool:
    """Triton's default launch hook is an empty chain: a launcher may be given None instead."""
    return hook is None or getattr(hook, "calls", None) == []


def _eager_only() -> bool:
    """True when this call must not replay: a launch trace is on (it notes each launch's settings),
    autocast is on (a replayed matmul would change dtype under the recorded kernels), Triton has
    launch hooks (a profiler), or the stream is being captured into a CUDA graph."""
    global _runtime_knobs, _compilation_knobs
    if _runtime_knobs is None:
        from triton import knobs
        _runtime_knobs, _compilation_knobs = knobs.runtime, knobs.compilation
    return (eager_calls > 0 or torch.is_autocast_enabled("cuda") or not no_hooks(_runtime_knobs.launch_enter_hook)
            or not no_hooks(_runtime_knobs.launch_exit_hook) or torch._C._cuda_isCurrentStreamCapturing())
