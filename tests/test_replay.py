"""The replay of a recorded call (moe_kernels._replay) on the CPU: torch operations through the
dispatch mode and a stand-in for a compiled Triton kernel that reads and writes raw pointers, so
that every pointer a replay passes is checked by what lands in memory. The GPU tests replay the
real entry points (tests/test_layer_path.py)."""

import ctypes

import pytest
import torch

from moe_kernels import _replay


class FakeCompiled:
    """A compiled kernel's launcher: ``out[i] = 2 * src[i] + bias`` over ``n`` float32s, through
    pointers (tensors at the recorded call, integers at a replay, as Triton's launcher takes)."""

    function, packed_metadata = "function", "metadata"

    def __init__(self):
        self.launches = []

    def run(self, gx, gy, gz, stream, function, metadata, launch_metadata, enter, leave, src, out, n, bias):
        assert (function, metadata, enter, leave) == ("function", "metadata", None, None)
        pointer = lambda a: a.data_ptr() if isinstance(a, torch.Tensor) else a  # noqa: E731
        values = (ctypes.c_float * n).from_address(pointer(src))
        result = (ctypes.c_float * n).from_address(pointer(out))
        for i in range(n):
            result[i] = 2 * values[i] + bias
        self.launches.append((gx, gy, gz, type(src).__name__))


@pytest.fixture
def fake_stream(monkeypatch):
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 0, raising=False)


def launch(kernel, src, out, n, bias=1.0):
    """What the launch shortcut does: launch, then tell the call being recorded (if any)."""
    kernel.run(4, 1, 1, 0, kernel.function, kernel.packed_metadata, None, None, None, src, out, n, bias)
    recording = _replay.recording_now()
    if recording is not None:
        recording.note_launch(kernel, (4,), 0, (src, out, n, bias))


def layer_like(x, w, kernel, constant):
    """Torch operations, views that only feed a launch, a launch into the middle of a buffer, an
    in-place addition and a tensor from outside the call."""
    h = torch.mm(x, w)                       # [T, 3]
    buffer = torch.empty(2 * h.numel())
    launch(kernel, h.view(-1), buffer[h.numel():], h.numel())   # a view at an offset
    out = buffer[h.numel():].view(h.shape)
    return out.add_(constant)


def run_plans(plans, key, args, eager):
    plan = plans.get(key)
    return plan.replay(args) if plan is not None else plans.call(key, args, eager)


def test_replay_matches_the_eager_call_on_new_inputs(fake_stream):
    kernel, constant = FakeCompiled(), torch.tensor([1.0, 2.0, 3.0])
    plans = _replay.CallPlans("test")
    g = torch.Generator().manual_seed(0)
    for call in range(5):
        x, w = torch.randn(2, 4, generator=g), torch.randn(4, 3, generator=g)
        expected = (2 * (x @ w) + 1.0) + constant
        got = run_plans(plans, "key", (x, w), lambda: layer_like(x, w, kernel, constant))
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
        assert (plans.get("key") is not None) == (call >= 1)   # recorded at the second call
    plan = plans.get("key")
    assert plan.replays == 3 and plan.num_launches == 1
    # The matmul, the buffer and the view returned (with the slice under it) and the addition are
    # redone; the view that only fed the launch is not.
    ops = plan.operations()
    assert ops[:2] == ["aten.mm.default", "aten.empty.memory_format"] and ops[-1] == "aten.add_.Tensor", ops
    assert "aten.view.default" in ops and len(ops) <= 6, ops
    assert [l[3] for l in kernel.launches] == ["Tensor"] * 2 + ["int"] * 3   # replays pass integers


def test_operations_replay_through_torch_bindings_and_views_of_constants_are_made_once(fake_stream):
    plans, weight = _replay.CallPlans("test"), torch.randn(3, 4)

    def call(x):   # x @ weight.t(): the transpose of a constant is a constant; the slice has no binding
        return torch.mm(x, weight.t())[:, 1:].mul(2.0)

    for _ in range(4):
        x = torch.randn(2, 4)
        torch.testing.assert_close(run_plans(plans, "key", (x,), lambda: call(x)), (x @ weight.t())[:, 1:] * 2)
    plan = plans.get("key")
    assert plan.operations() == ["aten.mm.default", "aten.slice.Tensor", "aten.mul.Tensor"], plan.operations()
    calls = [step[1] for step in plan.steps if not step[0]]
    assert calls[0] is torch._C._VariableFunctions.mm                     # torch.mm's binding
    assert calls[1] == torch.ops.aten.slice.Tensor._op                    # the overload itself
    weight.data = torch.randn(3, 4)   # the folded transpose is of the old memory: the plan is forgotten
    assert plans.get("key") is None


def test_a_returned_view_of_a_constant_is_a_new_tensor_at_every_replay(fake_stream):
    plans, table = _replay.CallPlans("test"), torch.arange(6.0).view(2, 3)
    outs = []
    for _ in range(4):
        x = torch.randn(3)
        outs.append(run_plans(plans, "key", (x,), lambda: (x * 2, table.t())))
    assert plans.get("key").replays == 2 and outs[2][1] is not outs[3][1]
    outs[2][1].unsqueeze_(0)   # a caller's in-place change to its own result stays its own
    assert plans.get("key").replay((torch.randn(3),))[1].shape == (3, 2)


def test_a_constant_reshaped_in_place_forgets_the_plan(fake_stream):
    plans, weight = _replay.CallPlans("test"), torch.randn(4, 6)
    for _ in range(3):
        x = torch.randn(2, 6)
        run_plans(plans, "key", (x,), lambda: x @ weight.t())
    weight.data = weight.data.view(6, 4)   # the same address, another shape
    assert plans.get("key") is None


def test_a_replayed_descriptor_keeps_every_field_of_the_recorded_one():
    pytest.importorskip("triton")
    from triton.tools.tensor_descriptor import TensorDescriptor

    desc = TensorDescriptor.from_tensor(torch.zeros(64, 32), [16, 32])
    fields = _replay._descriptor_fields(desc)
    replayed = _replay._Descriptor(4096, fields)
    assert replayed.base.data_ptr() == 4096 and "base" not in fields
    for name, value in fields.items():   # (Triton 3.9's launcher reads round_f32_to_tf32 too)
        assert getattr(replayed, name) == value


def stretch_call(x, kernel, writes_an_earlier_slot=False):
    """A layer's shape of call: a main step, a marked stretch (a shared expert: its buffer and a launch into it),
    a main launch, then the sum that reads the stretch's output."""
    from moe_kernels._replay_fork import side_stream_stretch

    h = x * 2                                   # main, before the stretch
    with side_stream_stretch(_replay.recording_now()):
        shared = torch.empty(x.numel())
        launch(kernel, x, shared, x.numel())    # the stretch's launch: 2x + 1
        if writes_an_earlier_slot:
            h.add_(1)                           # writes a slot made before the stretch: may not fork
    routed = torch.empty(x.numel())
    launch(kernel, h, routed, x.numel())        # main, beside the stretch: 4x + 1
    return routed + shared                      # the join goes before this


def test_a_marked_stretch_is_planned_with_a_join_before_its_first_reader(fake_stream):
    kernel, plans = FakeCompiled(), _replay.CallPlans("test")
    for _ in range(3):
        x = torch.randn(5)
        torch.testing.assert_close(run_plans(plans, "key", (x,), lambda: stretch_call(x, kernel)), 6 * x + 2)
    plan = plans.get("key")
    assert plan.forks
    kinds = [step[1] if step[0] is None else "launch" if step[0] else str(step[8]) for step in plan.steps]
    empty = "aten.empty.memory_format"
    assert kinds == ["aten.mul.Tensor", "fork", empty, "launch", "fork_end", empty, "launch", "join",
                     "aten.add.Tensor"], kinds
    assert plan.num_ops == 4 and plan.num_launches == 2
    # Written in place inside the stretch, a slot made before it: the stretch runs in line, unmarked
    plans = _replay.CallPlans("test")
    for _ in range(3):
        x = torch.randn(5)
        torch.testing.assert_close(run_plans(plans, "key", (x,), lambda: stretch_call(x, kernel, True)), 6 * x + 4)
    assert not plans.get("key").forks and all(step[0] is not None for step in plans.get("key").steps)


class FakeStream:
    """A CUDA stream as Fork uses it: a name, a device, and the streams it was made to wait for."""

    def __init__(self, name):
        self.name, self.device, self.waits = name, "cpu", []

    def wait_stream(self, other):
        self.waits.append(other.name)


@pytest.fixture
def fake_streams(monkeypatch):
    """torch.cuda's current stream, its stream context and the raw handle a launch takes, on fakes: the current
    stream's name is what a replayed launch is given."""
    import contextlib

    main = FakeStream("main")
    current = [main]

    @contextlib.contextmanager
    def stream(s):
        current.append(s)
        try:
            yield
        finally:
            current.pop()

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[-1])
    monkeypatch.setattr(torch.cuda, "stream", stream)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: current[-1].name, raising=False)
    return main, current


class StreamNotingCompiled(FakeCompiled):
    """FakeCompiled that notes the stream each launch was given, and can fail on a chosen launch."""

    def __init__(self, fail_at=None):
        super().__init__()
        self.streams, self.fail_at = [], fail_at

    def run(self, gx, gy, gz, stream, *args):
        self.streams.append(stream)
        if len(self.streams) == self.fail_at:
            raise RuntimeError("launch failed")
        super().run(gx, gy, gz, stream, *args)


def test_a_fork_issues_the_stretch_on_the_side_stream_and_joins(fake_stream, fake_streams):
    """What a capture does with the plan: the stretch's launch on the side stream, forked after the steps before it,
    the main stream's launch on the main stream, the join before the sum; the caller's stream current again after,
    also when a launch inside the stretch fails. A plain replay gives every launch the current stream."""
    main, current = fake_streams
    kernel, plans = StreamNotingCompiled(), _replay.CallPlans("test")
    for _ in range(2):
        x = torch.randn(5)
        run_plans(plans, "key", (x,), lambda: stretch_call(x, kernel))
    plan, side = plans.get("key"), FakeStream("side")
    kernel.streams.clear()
    x = torch.randn(5)
    torch.testing.assert_close(plan.replay((x,), fork=side), 6 * x + 2)
    assert kernel.streams == ["side", "main"] and side.waits == ["main"] and main.waits == ["side"]
    assert current == [main]
    kernel.streams.clear()
    torch.testing.assert_close(plan.replay((x,)), 6 * x + 2)   # plain: in order, on the current stream
    assert kernel.streams == ["main", "main"]
    kernel.fail_at, kernel.streams = 1, []
    with pytest.raises(RuntimeError, match="launch failed"):
        plan.replay((x,), fork=side)
    assert current == [main]


def test_a_later_write_to_what_the_stretch_read_joins_first():
    """A step after the stretch that writes a slot the stretch read (an in-place operation on the input, or a launch
    into a buffer the call made before the stretch) waits for the stretch: the join goes before it."""
    from moe_kernels._replay_fork import with_join

    slot = _replay._Slot
    fork, end, join = ("mark", "fork"), ("mark", "fork_end"), ("mark", "join")
    h = ("op", torch.ops.aten.mul.Tensor, (slot(0), 2), {}, (1,), False)                  # made before: slot 1
    reads_h = ("op", torch.ops.aten.mul.Tensor, (slot(1), 2), {}, (2,), False)             # in the stretch
    into_h = ("launch", None, (1, 1, 1), 0, [None], ((0, 1, 0, None),))                    # after it, onto h
    into_x = ("launch", None, (1, 1, 1), 0, [None], ((0, 0, 0, None),))                    # the input: a read
    x_in_place = ("op", torch.ops.aten.add_.Tensor, (slot(0), slot(1)), {}, (0,), False)
    outside = frozenset({0})
    assert with_join([h, fork, reads_h, end, into_x, into_h], outside) == [h, fork, reads_h, end, into_x, join, into_h]
    reads_x = ("op", torch.ops.aten.mul.Tensor, (slot(0), 3), {}, (3,), False)
    assert with_join([h, fork, reads_x, end, x_in_place], outside) == [h, fork, reads_x, end, join, x_in_place]
    # a launch of the stretch that points into a slot made before it (it may write it): in line
    stretch_into_h = ("launch", None, (1, 1, 1), 0, [None], ((0, 1, 0, None),))
    assert with_join([h, fork, reads_x, stretch_into_h, end], outside) == [h, reads_x, stretch_into_h]


def test_with_join_drops_marks_it_cannot_honour():
    from moe_kernels._replay_fork import with_join

    made = ("op", torch.ops.aten.empty.memory_format, ([4],), {}, (5,), False)
    reads = ("launch", None, (1, 1, 1), 0, [None], ((0, 5, 0, None),))
    fork, end = ("mark", "fork"), ("mark", "fork_end")
    assert with_join([fork, made, end]) == [fork, made, end, ("mark", "join")]   # read by nothing: join at the end
    for events in ([fork, made], [end, made, fork, reads], [fork, made, end, fork, made, end, reads],
                   [fork, reads, end, reads]):   # unclosed, out of order, two stretches, one that makes nothing
        assert with_join(events) == [e for e in events if e[0] != "mark"], events


def test_a_binding_that_dispatches_elsewhere_is_not_used():
    recording, x = _replay.Recording((torch.randn(2, 2),)), _replay._Slot(0)
    add = ("op", torch.ops.aten.add.Tensor, (x, x), {"alpha": 2}, (1,), False)
    assert recording._binding(add) is torch._C._VariableFunctions.add   # the same overload
    # torch.mul(t, 2.0) wraps the number and reaches aten.mul.Tensor, not the recorded mul.Scalar
    times_two = ("op", torch.ops.aten.mul.Scalar, (x, 2.0), {}, (1,), False)
    assert recording._binding(times_two) == torch.ops.aten.mul.Scalar._op


def test_buffers_only_launches_touch_share_one_workspace(fake_stream):
    kernel, plans = FakeCompiled(), _replay.CallPlans("test")

    def chain(x):   # two intermediate buffers that only launches read and write
        a, b, out = torch.empty(x.numel()), torch.empty(x.numel()), torch.empty(x.numel())
        launch(kernel, x, a, x.numel())
        launch(kernel, a, b, x.numel())
        launch(kernel, b, out, x.numel())
        return out

    for _ in range(4):
        x = torch.randn(5)
        torch.testing.assert_close(run_plans(plans, "key", (x,), lambda: chain(x)), ((2 * x + 1) * 2 + 1) * 2 + 1)
    plan = plans.get("key")
    assert plan.workspace == (2 * 512, x.device)   # two pieces, each on its own 512-byte boundary
    assert plan.operations() == ["aten.empty.memory_format"]   # the result


def test_a_call_that_reads_values_back_is_not_replayed(fake_stream):
    plans = _replay.CallPlans("test")
    x = torch.randn(3)

    def host_branch():   # the host's path depends on a value: a replay could not follow it
        return x * 2 if x.sum().item() > 0 else x * 3

    for _ in range(_replay.MAX_REFUSALS + 3):
        run_plans(plans, "key", (x,), host_branch)
    assert plans.get("key") is None and "reads values back" in plans.last_refusal
    assert plans.calls["key"] > _replay.MAX_REFUSALS   # given up: eager from now on


def test_inputs_that_share_memory_are_not_replayed(fake_stream):
    plans = _replay.CallPlans("test")
    base = torch.randn(8)
    a, b = base[:4], base[4:]
    for _ in range(3):
        run_plans(plans, "key", (a, b), lambda: a + b)
    assert plans.get("key") is None and plans.last_refusal == "two inputs share memory"


def test_integer_indexing_is_replayed_and_a_mask_is_not(fake_stream):
    plans = _replay.CallPlans("test")
    for _ in range(3):
        x, rows = torch.randn(4, 2), torch.tensor([3, 0, 3])
        torch.testing.assert_close(run_plans(plans, "rows", (x, rows), lambda: x[rows] * 2), x[rows] * 2)
        run_plans(plans, "mask", (x,), lambda: x[x > 0])   # a shape that depends on the values
    assert plans.get("rows") is not None and plans.get("rows").replays == 1
    assert plans.get("mask") is None and "reads values back" in plans.last_refusal


def test_a_result_from_outside_the_call_is_not_replayed(fake_stream):
    plans, kept = _replay.CallPlans("test"), torch.randn(3)
    for _ in range(3):
        run_plans(plans, "key", (torch.randn(3),), lambda: kept)
    assert plans.get("key") is None and "not made by the call" in plans.last_refusal


def test_new_tuned_tables_forget_every_plan(fake_stream):
    plans = _replay.CallPlans("test")
    x = torch.randn(3)
    for _ in range(3):
        run_plans(plans, "key", (x,), lambda: x * 2)
    assert plans.get("key") is not None
    _replay.forget_all_plans()
    assert plans.get("key") is None and not plans.calls


def test_an_input_that_shares_memory_with_a_constant_is_not_replayed(fake_stream):
    plans, weight = _replay.CallPlans("test"), torch.randn(4, 3)
    for _ in range(3):   # the input is a view of the weight the call also reads
        x = weight[:2]
        run_plans(plans, "key", (x,), lambda: torch.mm(x, weight.t()))
    assert plans.get("key") is None and "shares memory" in plans.last_refusal


def test_constants_may_share_memory_with_each_other(fake_stream):
    plans, packed = _replay.CallPlans("test"), torch.randn(6, 3)
    weight, other = packed[:3], packed[3:]   # two views of one buffer, both from outside the call
    for _ in range(3):
        x = torch.randn(2, 3)
        got = run_plans(plans, "key", (x,), lambda: torch.mm(x, weight) + torch.mm(x, other))
        torch.testing.assert_close(got, x @ weight + x @ other)
    assert plans.get("key") is not None and plans.get("key").replays == 1


def test_a_plan_whose_constant_moved_is_forgotten(fake_stream):
    plans, weight = _replay.CallPlans("test"), torch.randn(3, 3)
    for _ in range(3):
        x = torch.randn(2, 3)
        run_plans(plans, "key", (x,), lambda: torch.mm(x, weight))
    assert plans.get("key") is not None
    weight.data = torch.randn(3, 3)   # no __setattr__ sees this: the plan checks its constants' addresses
    assert plans.get("key") is None
    x = torch.randn(2, 3)
    torch.testing.assert_close(run_plans(plans, "key", (x,), lambda: torch.mm(x, weight)), x @ weight)


def test_an_operation_kept_for_its_effect_alone(fake_stream):
    plans = _replay.CallPlans("test")

    def checked(x):
        torch._assert_async(torch.tensor(True))   # returns nothing; a replay must still run it
        return x * 2

    for _ in range(3):
        x = torch.randn(3)
        run_plans(plans, "key", (x,), lambda: checked(x))
    assert "aten._assert_async.default" in plans.get("key").operations()


class FakeDescriptorCompiled(FakeCompiled):
    """A launcher whose source is a TMA tensor descriptor, read as Triton's launcher reads one
    (``base.data_ptr()``, ``shape``, ``strides``: it encodes the hardware descriptor from them)."""

    def run(self, gx, gy, gz, stream, function, metadata, launch_metadata, enter, leave, src, out, n, bias):
        assert tuple(src.strides) == (1,) and tuple(src.shape) == (n,)
        super().run(gx, gy, gz, stream, function, metadata, launch_metadata, enter, leave, src.base.data_ptr(),
                    out, n, bias)


def test_a_launch_through_a_tensor_descriptor_is_replayed_on_the_new_base(fake_stream):
    pytest.importorskip("triton")
    from triton.tools.tensor_descriptor import TensorDescriptor

    kernel, plans = FakeDescriptorCompiled(), _replay.CallPlans("test")

    def through_descriptor(x):
        out = torch.empty(x.numel())
        launch(kernel, TensorDescriptor.from_tensor(x[4:], [4]), out[:4], 4)   # a view at an offset
        return out[:4]

    for _ in range(4):
        x = torch.randn(8)
        torch.testing.assert_close(run_plans(plans, "key", (x,), lambda: through_descriptor(x)), 2 * x[4:] + 1)
    assert plans.get("key").replays == 2


def test_launch_key_of_a_tensor_descriptor_is_what_triton_specialises():
    pytest.importorskip("triton")
    from triton.tools.tensor_descriptor import TensorDescriptor

    from moe_kernels._launch import argument_key, cached_launch_kernel_class

    cached_launch_kernel_class()   # (sets the descriptor class the key recognises)
    a, b = torch.zeros(64, 32), torch.zeros(128, 32)
    key = lambda t, box, padding="zero": argument_key(TensorDescriptor.from_tensor(t, box, padding), False)  # noqa
    assert key(a, [16, 32]) == key(b, [16, 32])          # base, shape and strides are launch-time values
    assert key(a, [16, 32]) != key(a, [32, 32])          # the box is part of the binary
    assert key(a, [16, 32]) != key(a.half(), [16, 32])   # so is the element type
    assert key(a, [16, 32]) != key(a, [16, 32], "nan")


def test_launch_key_of_a_gluon_descriptor_holds_its_layout():
    """A Gluon kernel's TMA descriptor carries its shared-memory layout, which is part of the kernel's type: two
    layouts are two keys; the class that launches Gluon kernels is Gluon's JITFunction with the shortcut."""
    pytest.importorskip("triton")
    try:
        from triton.experimental.gluon import language as gl
        from triton.experimental.gluon._runtime import GluonJITFunction
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    except ImportError as error:
        pytest.skip(f"no Gluon for NVIDIA GPUs in this Triton ({error})")

    from moe_kernels._launch import argument_key, cached_launch_kernel_class

    assert issubclass(cached_launch_kernel_class(gluon=True), GluonJITFunction)
    a, b = torch.zeros(64, 128, dtype=torch.float16), torch.zeros(128, 128, dtype=torch.float16)
    wide = gl.NVMMASharedLayout.get_default_for([16, 128], gl.float16)   # (128-byte swizzle)
    narrow = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=16, rank=2)
    key = lambda t, layout: argument_key(TensorDescriptor.from_tensor(t, [16, 128], layout), False)  # noqa: E731
    assert key(a, wide) == key(b, wide) and key(a, wide) != key(a, narrow)


def test_options_are_keyed_by_type_and_objects_by_identity():
    key = _replay.options_key
    assert key(64) != key(64.0) and key(True) != key(1) and key(None) == key(None)
    a, b = tuple([1, 2]), tuple([1, 2])   # equal, distinct objects (a config with a field of the wrong type is one)
    assert key(a) != key(b) and key(a) == key(a)


def test_a_layer_with_plans_pickles_without_them():
    import pickle

    plans = _replay.CallPlans("test")
    plans.plans["key"] = object()
    restored = pickle.loads(pickle.dumps(plans))
    assert restored.name == "test" and not restored.plans and restored in _replay._all_plans


def test_no_key_on_the_cpu_or_for_odd_arguments():
    plans = _replay.CallPlans("test")
    assert plans.key((torch.randn(2),), ()) is None              # a CPU tensor: eager
    assert plans.key(("not a tensor",), ()) is None               # the eager path names the error
    assert plans.call(None, (), lambda: "eager") == "eager"


# ----------------------------------------------------------------------------------------------
# On a GPU: the real entry points, replayed against their eager calls
# ----------------------------------------------------------------------------------------------

from moe_testing import needs_gpu  # noqa: E402

FORMATS = (None, "block", "channel", "tensor")


def _small_layer(model, fmt, layout="index_gather", shared_expert="separate", seed=0):
    from moe_kernels.layer import MoELayer

    layer = MoELayer.random(model, hidden_size=256, intermediate_size=256, dtype=torch.bfloat16, device="cuda",
                            seed=seed)
    if fmt is not None:
        layer = layer.quantized(fmt)
    if layout != "index_gather" or shared_expert != "separate":
        layer = type(layer)(layer.weights, layer.routing, layout=layout, shared_expert=shared_expert)
    return layer


def _eagerly(fn, monkeypatch):
    with monkeypatch.context() as m:
        m.setattr(_replay, "ENABLED", False)
        return fn()


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("num_tokens", [1, 7, 64, 300])
def test_fused_experts_replays_as_it_runs_gpu(fmt, num_tokens, monkeypatch):
    from moe_kernels.kernels.index_gather import _PLANS, fused_experts

    layer = _small_layer("qwen3-30b-a3b", fmt)
    e, k = layer.w13.shape[0], layer.routing.top_k
    g = torch.Generator(device="cuda").manual_seed(num_tokens)
    outputs = []
    for call in range(4):
        x = torch.randn(num_tokens, 256, device="cuda", dtype=torch.bfloat16, generator=g)
        ids = torch.rand(num_tokens, e, device="cuda", generator=g).argsort(1)[:, :k].int()
        w = torch.rand(num_tokens, k, device="cuda", generator=g)
        run = lambda: fused_experts(x, layer.w13, layer.w2, w, ids, w1_scale=layer.w13_scale,  # noqa: E731
                                    w2_scale=layer.w2_scale)
        got, expected = run(), _eagerly(run, monkeypatch)
        assert torch.equal(got, expected), (call, (got.float() - expected.float()).abs().max())
        outputs.append((got, got.clone()))
    key = _PLANS.key((x, layer.w13, layer.w2, w, ids, layer.w13_scale, layer.w2_scale), (None, None, None, True))
    plan = _PLANS.get(key)
    assert plan is not None and plan.replays >= 2, _PLANS.last_refusal
    assert all(torch.equal(a, b) for a, b in outputs)   # each replay wrote a fresh output
    assert _graphs_of(plan) == 1, plan.graphs.refusal   # the fourth call ran as one CUDA graph


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("fmt", [None, "block"])
def test_both_gemms_in_two_phases_replay_gpu(fmt, monkeypatch):
    """The two-phase launch (both GEMMs in one kernel: the H100's tables take it at 1-5 tokens) is recorded and
    replayed in 16 bits too: its fp8 scratch, unread there, is not an empty tensor that a recording refuses."""
    from moe_kernels.kernels.config import GemmTiles, MoEConfig, OneLaunchTiles
    from moe_kernels.kernels.index_gather import _PLANS, fused_experts

    layer = _small_layer("qwen3-30b-a3b", fmt)
    e, k = layer.w13.shape[0], layer.routing.top_k
    config = MoEConfig(16, GemmTiles(16, 128), GemmTiles(16, 128),
                       one_launch=OneLaunchTiles(16, 64, 4, 3, phases=2, block_k=128, swap_ab=True))
    g = torch.Generator(device="cuda").manual_seed(5)
    for call in range(4):
        x = torch.randn(2, 256, device="cuda", dtype=torch.bfloat16, generator=g)
        ids = torch.rand(2, e, device="cuda", generator=g).argsort(1)[:, :k].int()
        w = torch.rand(2, k, device="cuda", generator=g)
        run = lambda: fused_experts(x, layer.w13, layer.w2, w, ids, config=config,  # noqa: E731
                                    w1_scale=layer.w13_scale, w2_scale=layer.w2_scale)
        got, expected = run(), _eagerly(run, monkeypatch)
        assert torch.equal(got, expected), call
    key = _PLANS.key((x, layer.w13, layer.w2, w, ids, layer.w13_scale, layer.w2_scale), (None, config, None, True))
    plan = _PLANS.get(key)
    assert plan is not None and _graphs_of(plan) == 1, _PLANS.last_refusal


def _graphs_of(plan):
    """How many CUDA graphs a plan has captured, over its streams."""
    return sum(len(s.graphs) for s in plan.graphs.by_stream.values())


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("fmt", [None, "block"])
def test_graphs_per_weight_set_and_stream_gpu(fmt, monkeypatch):
    """A model's layers call fused_experts with one signature and their own weights: one graph
    per weight set, each reading its own weights; a second stream gets its own static buffers.
    Every call equals the eager call, in any order of the layers."""
    from moe_kernels.kernels.index_gather import _PLANS, fused_experts

    layers = [_small_layer("qwen3-30b-a3b", fmt, seed=seed) for seed in (0, 1)]   # other weights, one signature
    e, k = layers[0].w13.shape[0], layers[0].routing.top_k
    g = torch.Generator(device="cuda").manual_seed(7)
    side = torch.cuda.Stream()
    order = [0, 1, 0, 1, 1, 0, 0, 1, 0, 1, 1, 0]
    for call, which in enumerate(order):
        layer = layers[which]
        x = torch.randn(5, 256, device="cuda", dtype=torch.bfloat16, generator=g)
        ids = torch.rand(5, e, device="cuda", generator=g).argsort(1)[:, :k].int()
        w = torch.rand(5, k, device="cuda", generator=g)
        run = lambda: fused_experts(x, layer.w13, layer.w2, w, ids, w1_scale=layer.w13_scale,  # noqa: E731
                                    w2_scale=layer.w2_scale)
        stream = side if call >= 8 else torch.cuda.current_stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            got = run()
        torch.cuda.current_stream().wait_stream(stream)
        expected = _eagerly(run, monkeypatch)
        assert torch.equal(got, expected), (call, which, (got.float() - expected.float()).abs().max())
    plan = _PLANS.get(_PLANS.key((x, layer.w13, layer.w2, w, ids, layer.w13_scale, layer.w2_scale),
                                 (None, None, None, True)))
    assert plan is not None and len(plan.graphs.by_stream) == 2
    assert _graphs_of(plan) >= 2, plan.graphs.refusal


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("limit", ["MAX_GRAPH_BYTES", "MAX_GRAPH_COPY_BYTES", "MAX_STATIC_BYTES"])
def test_plans_above_the_graph_limits_replay_plainly_gpu(limit, monkeypatch):
    """A plan whose buffers exceed MAX_GRAPH_BYTES, whose copied inputs and output exceed
    MAX_GRAPH_COPY_BYTES, or whose static buffers would exceed the process's MAX_STATIC_BYTES,
    keeps the plain replay."""
    from moe_kernels import _replay_graphs
    from moe_kernels.kernels.index_gather import _PLANS, fused_experts

    import gc

    _PLANS.clear()   # (a plan of the other parametrisation would be reused with its refusal)
    gc.collect()
    monkeypatch.setattr(_replay_graphs, limit, 0)
    layer = _small_layer("qwen3-30b-a3b", None)
    e, k = layer.w13.shape[0], layer.routing.top_k
    x = torch.randn(3, 256, device="cuda", dtype=torch.bfloat16)
    ids = torch.rand(3, e, device="cuda").argsort(1)[:, :k].int()
    w = torch.rand(3, k, device="cuda")
    results = [fused_experts(x, layer.w13, layer.w2, w, ids, validate_ids=False) for _ in range(6)]
    assert all(torch.equal(r, results[0]) for r in results)
    plan = _PLANS.get(_PLANS.key((x, layer.w13, layer.w2, w, ids, None, None), (None, None, None, False)))
    assert plan is not None and plan.replays >= 3 and _graphs_of(plan) == 0
    if limit in ("MAX_GRAPH_BYTES", "MAX_GRAPH_COPY_BYTES"):   # refused for good
        assert limit in plan.graphs.refusal
    else:   # no room in the budget: no refusal for good, a longer wait before the next try
        assert plan.graphs.refusal is None and all(s.backoff > 0 for s in plan.graphs.by_stream.values())


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("persistent", [0, 1])
def test_weights_loaded_through_tensor_descriptors_are_replayed_gpu(persistent, monkeypatch):
    """The tiles the large-batch tables take (TMA weight loads): replayed, bit-equal to eager."""
    from moe_kernels.kernels.config import GemmTiles, MoEConfig
    from moe_kernels.kernels.index_gather import _PLANS, fused_experts

    layer = _small_layer("qwen3-30b-a3b", None)
    e, k = layer.w13.shape[0], layer.routing.top_k
    tiles = GemmTiles(64, 64, num_warps=4, num_stages=3, tma=True, persistent=persistent)
    config = MoEConfig(64, tiles, tiles)
    g = torch.Generator(device="cuda").manual_seed(1)
    for call in range(4):
        x = torch.randn(200, 256, device="cuda", dtype=torch.bfloat16, generator=g)
        ids = torch.rand(200, e, device="cuda", generator=g).argsort(1)[:, :k].int()
        w = torch.rand(200, k, device="cuda", generator=g)
        run = lambda: fused_experts(x, layer.w13, layer.w2, w, ids, config=config)  # noqa: E731
        got, expected = run(), _eagerly(run, monkeypatch)
        assert torch.equal(got, expected), (call, (got.float() - expected.float()).abs().max())
    plan = _PLANS.get(_PLANS.key((x, layer.w13, layer.w2, w, ids, None, None), (None, config, None, True)))
    assert plan is not None and plan.replays >= 2, _PLANS.last_refusal
    assert any(p[3] is not None for step in plan.steps if step[0] for p in step[7])   # a descriptor was replayed


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("model,fmt,layout,shared", [
    ("qwen3-30b-a3b", None, "index_gather", "separate"), ("qwen3-30b-a3b", "block", "index_gather", "separate"),
    ("deepseek-v3", None, "index_gather", "separate"), ("deepseek-v3", "block", "index_gather", "separate"),
    ("deepseek-v3", None, "index_gather", "fused"), ("deepseek-v3", "block", "index_gather", "fused"),
    ("qwen3-30b-a3b", None, "permute", "separate"), ("qwen3-30b-a3b", "block", "permute", "separate"),
    ("qwen3-30b-a3b", None, "masked", "separate"),
])
@pytest.mark.parametrize("num_tokens", [1, 64, 300])
def test_layer_replays_as_it_runs_gpu(model, fmt, layout, shared, num_tokens, monkeypatch):
    layer = _small_layer(model, fmt, layout, shared)
    g = torch.Generator(device="cuda").manual_seed(num_tokens)
    for call in range(4):
        x = torch.randn(num_tokens, 256, device="cuda", dtype=torch.bfloat16, generator=g)
        got, expected = layer(x), _eagerly(lambda: layer(x), monkeypatch)
        assert torch.equal(got, expected), (call, (got.float() - expected.float()).abs().max())
    replay = layer._replays.get(layer._replays.key((x,), ()))
    assert replay is not None and replay.replays >= 2, layer._replays.last_refusal
    assert _graphs_of(replay) == 1, replay.graphs.refusal   # the fourth call ran as one CUDA graph
    # New weights: the layer forgets what it recorded, and the next calls use the new weights.
    layer.w2 = layer.w2 * 2 if layer.w2.dtype == torch.bfloat16 else layer.w2
    layer(x)
    assert layer._replays.get(layer._replays.key((x,), ())) is None


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("fmt", [None, "block"])
@pytest.mark.parametrize("num_tokens", [1, 8, 64])
def test_a_layers_shared_expert_forks_in_its_replay_graph_gpu(fmt, num_tokens, monkeypatch):
    """A layer with its shared expert apart, replayed by the package: recorded in line with the shared expert
    marked (moe_kernels._replay_fork); its CUDA graph issues the stretch on the capture side's fork stream and
    joins it; every call equals the eager one. With ``SHARED_BESIDE`` None nothing is marked."""
    from moe_kernels import _replay_fork, layer_shared

    seen, step = [], _replay_fork.Fork.step

    def spy(self, kind):   # where the stretch's steps run: captured, and on the fork stream after "fork"
        step(self, kind)
        seen.append((kind, torch.cuda.is_current_stream_capturing(), torch.cuda.current_stream() == self.side))

    monkeypatch.setattr(_replay_fork.Fork, "step", spy)
    for beside in ("experts", None):
        monkeypatch.setattr(layer_shared, "SHARED_BESIDE", beside)
        layer, g = _small_layer("deepseek-v3", fmt), torch.Generator(device="cuda").manual_seed(num_tokens)
        for call in range(5):
            x = torch.randn(num_tokens, 256, device="cuda", dtype=torch.bfloat16, generator=g)
            got, expected = layer(x), _eagerly(lambda: layer(x), monkeypatch)
            assert torch.equal(got, expected), (beside, call, (got.float() - expected.float()).abs().max())
        replay = layer._replays.get(layer._replays.key((x,), ()))
        assert replay is not None and _graphs_of(replay) == 1, (layer._replays.last_refusal, replay.graphs.refusal)
        kinds = [s[1] for s in replay.steps if s[0] is None]
        assert kinds == (["fork", "fork_end", "join"] if beside else []), kinds
    # once, in the capture (the plain replay before it and the graph's replays after it do not fork)
    assert seen == [("fork", True, True), ("fork_end", True, False), ("join", True, False)], seen


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("fmt", [None, "block"])
def test_a_forked_shared_expert_joins_after_a_two_phase_launch_gpu(fmt, monkeypatch):
    """Where the routed GEMMs are one two-phase launch (the H100's tables at DeepSeek-V3's bf16 one token), the
    replay's graph joins the forked shared expert after that launch, not before it (the launch no longer reads the
    addend: it is added after it), so the two run side by side; every call equals the eager one."""
    import dataclasses

    from moe_kernels import layer as layer_module
    from moe_kernels._runtime import record_launches
    from moe_kernels.kernels.config import OneLaunchTiles
    from moe_testing import rel_err

    tiles = OneLaunchTiles(16, 64, 4, 3, phases=2, block_k=128, swap_ab=True)
    choose = layer_module.choose_config

    def with_two_phases(m, e, *args, **kwargs):   # the routed experts' choice (not the shared expert's, e = 1)
        choice = choose(m, e, *args, **kwargs)
        return choice if e == 1 else dataclasses.replace(choice, config=dataclasses.replace(choice.config,
                                                                                            one_launch=tiles))

    monkeypatch.setattr(layer_module, "choose_config", with_two_phases)
    layer, g = _small_layer("deepseek-v3", fmt), torch.Generator(device="cuda").manual_seed(8)
    for call in range(5):
        x = torch.randn(1, 256, device="cuda", dtype=torch.bfloat16, generator=g)
        got, expected = layer(x), _eagerly(lambda: layer(x), monkeypatch)
        assert torch.equal(got, expected), (call, (got.float() - expected.float()).abs().max())
    assert rel_err(got, layer.reference(x)) < 2e-2
    replay = layer._replays.get(layer._replays.key((x,), ()))
    assert replay is not None and _graphs_of(replay) == 1, (layer._replays.last_refusal, replay.graphs.refusal)
    kinds = [s[1] if s[0] is None else ("launch" if s[0] else "op") for s in replay.steps]
    assert kinds.count("join") == 1 and "launch" not in kinds[kinds.index("join"):], kinds   # joined after the last
    with record_launches() as launches:   # (the path: the routed experts ran as the two-phase launch)
        _eagerly(lambda: layer(x), monkeypatch)
    assert "two_phase.experts" in [name for name, _ in launches], launches


@needs_gpu
@pytest.mark.gpu
def test_a_recorded_auto_layer_plans_for_the_forked_shared_expert_gpu(monkeypatch):
    """``shared_expert="auto"`` chooses between the slot and the shared expert apart by a measured crossover, which
    differs where the shared expert forks (``beside``). A call recorded for the package's replays plans as inside a
    capture, since the replay's graph forks; the eager calls around it plan in line. (The small test shape has no
    measured entry: the choice is spied on, and answers apart, so that the recording marks the shared expert.)"""
    from moe_kernels import layer as layer_module

    asked = []

    def spy(*args, beside=False, **kwargs):
        asked.append((beside, _replay.recording_now() is not None))
        return False

    monkeypatch.setattr(layer_module, "choose_shared_slot", spy)
    layer, g = _small_layer("deepseek-v3", "block", shared_expert="auto"), torch.Generator(device="cuda").manual_seed(3)
    for call in range(5):
        x = torch.randn(4, 256, device="cuda", dtype=torch.bfloat16, generator=g)
        got, expected = layer(x), _eagerly(lambda: layer(x), monkeypatch)
        assert torch.equal(got, expected), call
    replay = layer._replays.get(layer._replays.key((x,), ()))
    assert replay is not None and replay.forks and _graphs_of(replay) == 1
    assert asked == [(False, False), (True, True)], asked   # the first call, then the recorded one (cached after)


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("persistent", [False, True], ids=["per tile", "persistent"])
@pytest.mark.parametrize("num_tokens", [1, 64, 300])
def test_the_gluon_kernels_are_replayed_gpu(persistent, num_tokens, monkeypatch):
    """The fp8 permute layout on the Gluon kernels (FP8_GEMM = "gluon", one program a tile or the persistent
    grid): they launch through the package's shortcut, so the layer's recorded call replays them, bit-equal to
    the eager call, and its fourth call runs as one CUDA graph."""
    from moe_kernels._runtime import record_launches
    from moe_kernels.kernels import permute_gluon
    from moe_kernels.kernels.gluon_block_fp8 import available

    if available("cuda") is not None:
        pytest.skip(f"the Gluon kernels: {available('cuda')}")
    monkeypatch.setattr(permute_gluon, "FP8_GEMM", "gluon")
    monkeypatch.setattr(permute_gluon, "GLUON_PERSISTENT", persistent)
    layer = _small_layer("qwen3-30b-a3b", "block", "permute")
    g = torch.Generator(device="cuda").manual_seed(num_tokens)
    for call in range(4):
        x = torch.randn(num_tokens, 256, device="cuda", dtype=torch.bfloat16, generator=g)
        with record_launches() as launches:
            expected = _eagerly(lambda: layer(x), monkeypatch)
        assert [r["persistent"] for name, r in launches if name == "gluon_block_fp8.gemm"] == [persistent] * 2
        got = layer(x)
        assert torch.equal(got, expected), (call, (got.float() - expected.float()).abs().max())
    replay = layer._replays.get(layer._replays.key((x,), ()))
    assert replay is not None and replay.replays >= 2, layer._replays.last_refusal
    assert _graphs_of(replay) == 1, replay.graphs.refusal


@needs_gpu
@pytest.mark.gpu
def test_graphs_of_the_least_recent_plan_make_room_gpu(monkeypatch):
    """Past the static-buffer budget, a new graph drops the least recently used plan's graphs;
    that plan still answers right (plainly, then, after a longer wait, through a new graph)."""
    import collections
    import gc

    from moe_kernels import _replay_graphs
    from moe_kernels.kernels.index_gather import _PLANS, fused_experts

    _PLANS.clear()
    gc.collect()
    # A budget of this test's own: only its two plans count.
    monkeypatch.setattr(_replay_graphs, "_holders", collections.OrderedDict())
    monkeypatch.setattr(_replay_graphs, "static_bytes", 0)
    layer = _small_layer("qwen3-30b-a3b", None)
    e, k = layer.w13.shape[0], layer.routing.top_k

    def problem(tokens):
        x = torch.randn(tokens, 256, device="cuda", dtype=torch.bfloat16)
        ids = torch.rand(tokens, e, device="cuda").argsort(1)[:, :k].int()
        return x, torch.rand(tokens, k, device="cuda"), ids

    def plan_of(x, w, ids):
        return _PLANS.get(_PLANS.key((x, layer.w13, layer.w2, w, ids, None, None), (None, None, None, True)))

    try:
        a, b = problem(3), problem(5)
        expected = {n: _eagerly(lambda p=p: fused_experts(p[0], layer.w13, layer.w2, p[1], p[2]), monkeypatch)
                    for n, p in ((3, a), (5, b))}
        for _ in range(5):
            assert torch.equal(fused_experts(a[0], layer.w13, layer.w2, a[1], a[2]), expected[3])
        assert _graphs_of(plan_of(*a)) == 1 and _replay_graphs.static_bytes > 0
        # room for b only if a's graph goes: b's copied inputs and its output, minus one byte
        need_b = sum(t.nbytes for t in b) + expected[5].nbytes
        monkeypatch.setattr(_replay_graphs, "MAX_STATIC_BYTES", _replay_graphs.static_bytes + need_b - 1)
        for _ in range(5):
            assert torch.equal(fused_experts(b[0], layer.w13, layer.w2, b[1], b[2]), expected[5])
        assert _graphs_of(plan_of(*b)) == 1 and _graphs_of(plan_of(*a)) == 0   # a made room for b
        for _ in range(2 + 16 + 2):   # a waits 16 more replays after being dropped, then takes b's place
            assert torch.equal(fused_experts(a[0], layer.w13, layer.w2, a[1], a[2]), expected[3])
        assert _graphs_of(plan_of(*a)) == 1 and _graphs_of(plan_of(*b)) == 0
    finally:   # (a and b give their bytes back to this test's budget, not the module's)
        _PLANS.clear()
        gc.collect()
    assert _replay_graphs.static_bytes == 0


@needs_gpu
@pytest.mark.gpu
def test_graphs_capture_again_after_every_graph_went_gpu(monkeypatch):
    """A stream's pool can only be captured into while one of its graphs lives: after every
    graph of the stream is gone (plans forgotten), the next plan still captures a graph."""
    import gc

    from moe_kernels.kernels.index_gather import _PLANS, fused_experts

    layer = _small_layer("qwen3-30b-a3b", None)
    e, k = layer.w13.shape[0], layer.routing.top_k
    for tokens in (3, 6):
        _PLANS.clear()
        gc.collect()
        x = torch.randn(tokens, 256, device="cuda", dtype=torch.bfloat16)
        ids = torch.rand(tokens, e, device="cuda").argsort(1)[:, :k].int()
        w = torch.rand(tokens, k, device="cuda")
        expected = _eagerly(lambda: fused_experts(x, layer.w13, layer.w2, w, ids), monkeypatch)
        for _ in range(5):
            assert torch.equal(fused_experts(x, layer.w13, layer.w2, w, ids), expected)
        plan = _PLANS.get(_PLANS.key((x, layer.w13, layer.w2, w, ids, None, None), (None, None, None, True)))
        assert _graphs_of(plan) == 1, [s.refusal for s in plan.graphs.by_stream.values()]


@needs_gpu
@pytest.mark.gpu
def test_graphs_under_inference_mode_and_of_overlapping_inputs_gpu(monkeypatch):
    """Static buffers made under torch.inference_mode() still take copies outside it; an input
    whose elements overlap (an expand()ed weights tensor) keeps the plain replay, right."""
    from moe_kernels.kernels.index_gather import _PLANS, fused_experts

    _PLANS.clear()
    layer = _small_layer("qwen3-30b-a3b", None, seed=2)
    e, k = layer.w13.shape[0], layer.routing.top_k
    x = torch.randn(4, 256, device="cuda", dtype=torch.bfloat16)
    ids = torch.rand(4, e, device="cuda").argsort(1)[:, :k].int()
    w = torch.rand(4, k, device="cuda")
    expected = _eagerly(lambda: fused_experts(x, layer.w13, layer.w2, w, ids), monkeypatch)
    with torch.inference_mode():
        for _ in range(5):
            assert torch.equal(fused_experts(x, layer.w13, layer.w2, w, ids), expected)
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(fused_experts(x, layer.w13, layer.w2, w, ids), expected)
    plan = _PLANS.get(_PLANS.key((x, layer.w13, layer.w2, w, ids, None, None), (None, None, None, True)))
    assert _graphs_of(plan) == 1
    shared = torch.rand(1, k, device="cuda").expand(4, k)   # every token the same routing weights
    expected = _eagerly(lambda: fused_experts(x, layer.w13, layer.w2, shared, ids), monkeypatch)
    for _ in range(5):
        assert torch.equal(fused_experts(x, layer.w13, layer.w2, shared, ids), expected)
    plan = _PLANS.get(_PLANS.key((x, layer.w13, layer.w2, shared, ids, None, None), (None, None, None, True)))
    assert _graphs_of(plan) == 0 and any("overlapping" in (s.refusal or "") for s in plan.graphs.by_stream.values())
