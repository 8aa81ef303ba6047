"""Decode runs as CUDA-graph replays: every layout, the routers and the alignment must capture
(no host synchronisation, validation included) and give the right answer when replayed on new
inputs copied into the captured buffers. GPU only."""

import pytest
import torch

from moe_kernels import MoELayer, fused_experts, fused_topk, grouped_topk, moe_align_block_size
from moe_kernels.kernels.align import moe_align_block_size_reference
from moe_kernels.kernels.grouped_routing import grouped_topk_reference
from moe_kernels.kernels.routing import fused_topk_reference
from moe_testing import make_problem, needs_gpu, rel_err


def capture(fn):
    """``fn`` captured once (after a warm-up on a side stream) and its output tensor(s)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def fresh(shape, seed, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to("cuda", dtype)


@needs_gpu
@pytest.mark.parametrize("layout", ["index_gather", "permute", "masked"])
@pytest.mark.parametrize("model, shared", [("qwen3-30b-a3b", "separate"), ("deepseek-v3", "separate"),
                                           ("deepseek-v3", "fused")])
def test_layer_replays_on_new_inputs(model, shared, layout):
    layer = MoELayer.random(model, hidden_size=512, intermediate_size=256, dtype=torch.bfloat16, device="cuda",
                            seed=0, layout=layout, shared_expert=shared)
    x = fresh((64, 512), 1, torch.bfloat16)
    graph, out = capture(lambda: layer(x))
    for seed in (2, 3):
        x.copy_(fresh((64, 512), seed, torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(out, layer.reference(x)) < 1e-2


@needs_gpu
def test_validated_experts_capture():
    """The default call checks the ids with a device-side assert: it captures, and replays."""
    hidden, w1, w2, weights, ids = make_problem(40, 16, 4, 256, 128, torch.bfloat16, seed=4)
    graph, out = capture(lambda: fused_experts(hidden, w1, w2, weights, ids))
    new_ids = torch.rand(40, 16, generator=torch.Generator().manual_seed(5)).argsort(dim=1)[:, :4]
    ids.copy_(new_ids.to(ids))
    graph.replay()
    torch.cuda.synchronize()
    from moe_kernels import moe_reference

    assert rel_err(out, moe_reference(hidden, w1, w2, weights, ids)) < 1e-2


@needs_gpu
def test_routers_and_alignment_replay():
    hidden = fresh((300, 64), 6)
    logits = fresh((300, 256), 7)
    bias = fresh((256,), 8) * 0.01

    def route():
        w1, i1 = fused_topk(hidden, logits[:, :128], 8, True)
        w2, i2 = grouped_topk(hidden, logits, 8, True, 8, 4, scoring_func="sigmoid", routed_scaling_factor=2.5,
                              e_score_correction_bias=bias)
        return (w1, i1, w2, i2) + moe_align_block_size(i2, 16, 256)

    graph, outs = capture(route)
    for seed in (9, 10):
        logits.copy_(fresh((300, 256), seed))
        graph.replay()
        torch.cuda.synchronize()
        w1, i1 = fused_topk_reference(hidden, logits[:, :128], 8, True)
        w2, i2 = grouped_topk_reference(hidden, logits, 8, True, 8, 4, scoring_func="sigmoid",
                                        routed_scaling_factor=2.5, e_score_correction_bias=bias)
        assert torch.equal(outs[1], i1) and torch.equal(outs[3], i2)
        assert torch.allclose(outs[0], w1, atol=1e-6) and torch.allclose(outs[2], w2, atol=1e-6)
        for got, want in zip(outs[4:], moe_align_block_size_reference(i2, 16, 256)):
            assert torch.equal(got, want)


@needs_gpu
@pytest.mark.parametrize("layout", ["index_gather", "permute"])
def test_auto_shared_expert_switches_between_slot_and_apart_in_graphs(monkeypatch, layout):
    """``shared_expert="auto"`` with a stand-in choice (the slot up to 4 tokens): calls alternating between a slot
    batch (3 tokens) and an apart batch (9), six of each (the third of a size replays the second's launches), then
    one CUDA graph of each replayed on new inputs: every output is the reference's. (The permute layout never takes
    the slot: its batches run apart.)"""
    import moe_kernels.layer as layer_module

    monkeypatch.setattr(layer_module, "choose_shared_slot", lambda M, *args, **kwargs: M <= 4)
    layer = MoELayer.random("deepseek-v3", hidden_size=512, intermediate_size=256, dtype=torch.bfloat16,
                            device="cuda", seed=0, layout=layout, shared_expert="auto")
    assert layer.plan(3, dtype=torch.bfloat16).shared_slot == (layout == "index_gather")
    assert not layer.plan(9, dtype=torch.bfloat16).shared_slot
    for call in range(12):
        x = fresh((3 if call % 2 else 9, 512), 20 + call, torch.bfloat16)
        assert rel_err(layer(x), layer.reference(x)) < 1e-2, call
    inputs = {batch: fresh((batch, 512), batch, torch.bfloat16) for batch in (3, 9)}
    graphs = {batch: capture(lambda x=x: layer(x)) for batch, x in inputs.items()}
    for seed in (2, 3):
        for batch, (graph, out) in graphs.items():
            inputs[batch].copy_(fresh((batch, 512), 100 * seed + batch, torch.bfloat16))
            graph.replay()
            torch.cuda.synchronize()
            assert rel_err(out, layer.reference(inputs[batch])) < 1e-2, (batch, seed)


@needs_gpu
@pytest.mark.parametrize("fmt, tokens", [("none", 9), ("none", 20), ("block", 9)])
@pytest.mark.parametrize("layout", ["index_gather", "permute", "masked"])
def test_a_shared_expert_beside_the_routed_experts_captures_and_replays(monkeypatch, fmt, tokens, layout):
    """``layer_shared.SHARED_BESIDE`` ("experts", the default): while a graph is captured the shared expert's
    kernels are issued on the side stream (seen where they are made: bf16 on the dense tiles at 9 tokens, cuBLAS at
    20), and the replayed graph gives, on new inputs, the output of the same layer captured in line bit for bit (the
    same kernels on the same numbers: the fork quantises and gates the same activations itself, and the same sum or
    addition takes its output). Replays are off, so that every call runs the layer's Python."""
    from moe_kernels import _replay, layer_shared

    if fmt == "block" and layout == "masked":
        pytest.skip("the masked layout runs 16/32-bit weights only")
    monkeypatch.setattr(_replay, "ENABLED", False)
    layer = MoELayer.random("deepseek-v3", hidden_size=512, intermediate_size=256, dtype=torch.bfloat16,
                            device="cuda", seed=0, layout=layout)
    layer = layer.quantized(fmt) if fmt != "none" else layer
    streams = []   # the stream each shared-expert output was made on, with the capture's stream
    made = layer_shared.shared_expert_output
    monkeypatch.setattr(layer_shared, "shared_expert_output", lambda *args: (
        streams.append((torch.cuda.current_stream(), torch.cuda.is_current_stream_capturing())), made(*args))[1])
    graphs = {}
    for way in (None, "experts"):
        monkeypatch.setattr(layer_shared, "SHARED_BESIDE", way)
        x = fresh((tokens, 512), 7, torch.bfloat16)
        streams.clear()
        layer(x)   # (uncaptured: in line, on the current stream)
        assert [captured for _, captured in streams] == [False], way
        graph, out = capture(lambda x=x: layer(x))
        side = [stream for stream, captured in streams if captured]
        assert len(side) == 1, way
        forked = any(side[0] == s for s in layer_shared._side_streams.values())
        assert forked == (way is not None), way
        graphs[way] = (x, graph, out)
    for seed in (2, 3):
        for x, graph, _ in graphs.values():
            x.copy_(fresh((tokens, 512), seed, torch.bfloat16))
            graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(graphs["experts"][2], graphs[None][2]), seed
        assert rel_err(graphs["experts"][2], layer.reference(graphs["experts"][0])) < 2e-2, seed
