"""The bench command line on any machine: an unknown command is named, and every command checks its
arguments before it looks for a GPU (so these run, and fail the same way, with or without one)."""

from __future__ import annotations

import importlib

import pytest

from moe_kernels.bench.__main__ import COMMANDS, main


def test_unknown_command_is_named_with_a_suggestion(capsys):
    assert main(["swep"]) == 2
    out, err = capsys.readouterr()
    assert "moe_kernels.bench: unknown command 'swep'; did you mean 'sweep'?" in err
    assert "usage: python -m moe_kernels.bench <command>" in out


def test_unknown_command_without_a_close_one(capsys):
    assert main(["xyzzy"]) == 2
    err = capsys.readouterr().err
    assert "unknown command 'xyzzy'" in err and "did you mean" not in err


def test_help_and_no_command(capsys):
    assert main(["--help"]) == 0
    assert main([]) == 2
    out, err = capsys.readouterr()
    assert out.count("usage:") == 2 and err == ""


def test_every_command_has_a_main():
    for module, _ in COMMANDS.values():
        assert callable(importlib.import_module(f"moe_kernels.bench.{module}").main)


def _argparse_error(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "needs a CUDA GPU" not in err
    return err


@pytest.mark.parametrize("command", ["sweep", "tune", "fp8", "layer", "capacity"])
def test_unknown_model_fails_in_the_parser(capsys, command):
    err = _argparse_error(capsys, [command, "--models", "deepseek-v3,nosuch"])
    assert "argument --models: unknown models ['nosuch']; choose from [" in err and "'qwen3-30b-a3b'" in err


def test_unknown_model_of_decode_step_fails_in_the_parser(capsys):
    err = _argparse_error(capsys, ["decode-step", "--model", "nosuch"])
    assert "argument --model: invalid choice: 'nosuch'" in err


@pytest.mark.parametrize("argv", [
    ["sweep", "--batches", "0"], ["tune", "--batches", "8,x"], ["fp8", "--batches", ""],
    ["layouts", "--batches", "-1"], ["shared", "--batches", "1,,two"], ["decode-step", "--tokens", "0"],
])
def test_token_counts_must_be_positive_ints(capsys, argv):
    assert "expected a comma list of ints >= 1, got" in _argparse_error(capsys, argv)


@pytest.mark.parametrize("argv", [
    ["sweep", "--models", ","], ["sweep", "--rep-ms", "-1"], ["tune", "--warmup-ms", "nan"],
    ["tune", "--workers", "-2"], ["tune", "--budget-s", "soon"], ["skew", "--seed", "x"], ["ceilings", "--nosuch"],
    ["layer", "--formats", "mxfp4"],
])
def test_other_bad_arguments_fail_in_the_parser(capsys, argv):
    _argparse_error(capsys, argv)


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_command_records_where_it_is_told(capsys, command):
    """Every command takes ``--record`` with ``--results-dir`` and ``--name`` (a GPU run writes
    its record where the caller collects files, e.g. a remote machine's output folder); on a
    machine without a GPU the parse succeeds and the command stops at the GPU check."""
    if torch_cuda_available():
        pytest.skip("on a GPU the command would run")
    assert main([command, "--record", "--results-dir", "/nonexistent", "--name", "x"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def torch_cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.parametrize("argv, says", [
    (["tune", "--shared", "--models", "qwen3-30b-a3b"], "with --shared, every model must have a shared expert"),
    (["tune", "--shared", "--refine", "--models", "deepseek-v3"], "argument --shared: not with --refine"),
    (["tune", "--fused-shared", "--models", "qwen3-30b-a3b"], "with --fused-shared, every model must have one shared"),
    (["tune", "--fused-shared", "--shared", "--models", "deepseek-v3"], "argument --fused-shared: not with --shared"),
])
def test_tuning_shared_experts_needs_models_that_have_one(capsys, argv, says):
    assert says in _argparse_error(capsys, argv)


def test_shared_expert_compile_jobs_run_the_dense_block_map():
    """``tune --shared`` compiles each candidate on the dense block map that the layer's shared
    expert runs on: GEMM 1 (split over K too) and GEMM 2 without the top-k sum, here on the CPU
    (the interpreter, float32), every job compiled."""
    from moe_kernels.bench.tune_compile import _compile_jobs
    from moe_kernels.kernels.config import GemmTiles

    jobs = [{"d": 32, "f": 16, "top_k": 1, "block_m": 16, "naive": False, "dense": True, "gated": gated,
             "sum_slots": False, "device": "cpu", "dtype": "float32", "format": "none",
             "tiles": {**GemmTiles(16, 16, split_k=split).__dict__}}
            for gated, split in ((True, 1), (True, 2), (False, 1))]
    assert _compile_jobs(jobs) == 3


def test_naive_compile_jobs_build_the_timed_naive_group():
    """A naive map's ``NAIVE_GROUP`` is a constexpr that the token count sets, so the tuner's
    parallel compile must build each naive job with the group its batch times (here 8 tokens of
    top-8: 64; one token: none), or the timing compiles everything again, one by one."""
    import torch

    from moe_kernels._runtime import record_launches, use_triton
    from moe_kernels.bench.tune_compile import _compile_jobs
    from moe_kernels.kernels.blocks import naive_group_size
    from moe_kernels.kernels.config import GemmTiles

    if not use_triton(torch.zeros(1)):   # (no Triton, or a GPU machine, where CPU jobs run the torch references)
        pytest.skip("launch records are the Triton kernels', and these jobs are the CPU's")
    for tokens in (1, 2, 8):
        job = {"d": 32, "f": 16, "top_k": 8, "block_m": 16, "naive": True, "dense": False, "gated": True,
               "sum_slots": False, "device": "cpu", "dtype": "float32", "format": "none",
               "naive_group": naive_group_size(tokens, 8), "tiles": {**GemmTiles(16, 16).__dict__}}
        with record_launches() as launches:
            assert _compile_jobs([job]) == 1
        assert [s["naive_group"] for n, s in launches if n == "index_gather.gemm"] == [naive_group_size(tokens, 8)]


def test_tuning_a_shared_expert_end_to_end_on_the_cpu(monkeypatch):
    """``tune(..., shared=True)`` on a small one-expert shape, the timers replaced by a stand-in
    that runs each candidate once (the interpreter) and the candidates trimmed: every entry is a
    config the layer's lookup accepts for the index-gather layout, with nothing dense_expert would
    ignore (no sum in GEMM 2, no split GEMM 2, no PDL, no quantising epilogue); and the table it
    would write is the one the layer asks for its shared expert."""
    import dataclasses

    import torch

    from moe_kernels import MODELS, MoELayer
    from moe_kernels.bench import tune as tune_module
    from moe_kernels.bench import tune_candidates
    from moe_kernels.kernels.config import GemmTiles, MoEConfig, check_config, table_name
    from moe_kernels.model.shapes import shared_expert_shape

    small = dataclasses.replace(MODELS["deepseek-v3"], hidden_size=64, moe_intermediate_size=32, num_shared_experts=2)
    shape = shared_expert_shape(small)
    calls = iter(range(10**6))

    def once(fn, *args):   # a stand-in timer: run the call, give each candidate its own time
        fn()
        return 1.0 + (next(calls) % 7) / 10

    monkeypatch.setattr(tune_module, "graphed", lambda fn: fn)
    monkeypatch.setattr(tune_module, "median_ms", once)
    monkeypatch.setattr(tune_candidates, "tile_candidates", lambda rho, bm, gated, fmt=None: [
        GemmTiles(16, 32, 1, 4, 2), GemmTiles(32, 32, 1, 4, 2)])
    entries = tune_module.tune({"small:shared": shape}, [1, 16], dtype=torch.float32, seed=0, warmup_ms=0, rep_ms=0,
                               workers=0, log=lambda line: None, device="cpu", shared=True)
    assert [e["M"] for e in entries] == [1, 16] and {(e["E"], e["N"], e["K"]) for e in entries} == {(1, 64, 64)}
    for entry in entries:
        config = check_config("test", MoEConfig.from_dict(entry["config"]), layout="index_gather")
        assert not (config.sum_in_gemm or config.pdl or config.quant_in_gemm) and config.down.split_k == 1
        tried = {t["tiles"]["split_k"] for t in entry["tried"] if t.get("gemm") == "gate_up"}
        assert tried == {1, 2, 4} if entry["M"] == 1 else tried == {1, 2}   # GEMM 1 split at decode
    for key in ("deepseek-v3",):   # the real shape: the table the layer's shared-expert lookup asks for
        layer = MoELayer.random(key, dtype=torch.float32, device="cpu", seed=0, hidden_size=256, intermediate_size=64)
        asked = layer.plan(1, dtype=torch.float32).shared_choice.asked
        model = dataclasses.replace(MODELS[key], hidden_size=256, moe_intermediate_size=64)
        tuned = shared_expert_shape(model)
        assert asked == table_name(asked.split(",")[0].split("=")[1].replace("_", " "), tuned.num_experts,
                                   tuned.moe_intermediate_size, tuned.hidden_size, torch.float32, "index_gather")
    with pytest.raises(ValueError, match="refine"):
        tune_module.tune({"small:shared": shape}, [1], dtype=torch.float32, seed=0, warmup_ms=0, rep_ms=0, workers=0,
                         device="cpu", shared=True, refine=True)


def test_tuning_the_shared_expert_fused_as_slot_e_on_the_cpu(tmp_path, monkeypatch):
    """``tune(..., fused_shared=True)`` on a small DeepSeek-V3 shape, stand-in timers: every candidate runs
    top-(k+1) over E+1 experts with the shared expert (id E) in every token's last slot, the entries are keyed
    E+1, and the table they make is the one a layer built with ``shared_expert="fused"`` takes on that GPU
    (the routed layer keeps the routed table; with no E+1 table the fused layer takes the routed one too)."""
    import dataclasses
    import json

    import torch

    import moe_kernels.kernels.config as config_module
    from moe_kernels import MODELS, MoELayer
    from moe_kernels.bench import tune as tune_module
    from moe_kernels.bench import tune_candidates, tune_tables
    from moe_kernels.kernels import index_gather
    from moe_kernels.kernels.config import GemmTiles, MoEConfig, check_config, load_table

    small = dataclasses.replace(MODELS["deepseek-v3"], hidden_size=64, moe_intermediate_size=32, num_experts=8,
                                top_k=2, num_expert_groups=1, topk_groups=1)
    seen = []   # the ids of every GEMM 1 timed

    def gate_up(x, w1, blocks, top_k, **kwargs):
        seen.append((top_k, w1.shape[0], blocks))
        return real_gate_up(x, w1, blocks, top_k, **kwargs)

    real_gate_up = index_gather.expert_gate_up
    calls = iter(range(10**6))
    monkeypatch.setattr(index_gather, "expert_gate_up", gate_up)
    monkeypatch.setattr(tune_module, "graphed", lambda fn: fn)
    monkeypatch.setattr(tune_module, "median_ms", lambda fn, *args: (fn(), 1.0 + (next(calls) % 7) / 10)[1])
    monkeypatch.setattr(tune_candidates, "tile_candidates", lambda rho, bm, gated, fmt=None: [GemmTiles(16, 32, 1, 4, 2)])
    entries = tune_module.tune({"small": small}, [1, 8], dtype=torch.float32, seed=0, warmup_ms=0, rep_ms=0, workers=0,
                               log=lambda line: None, device="cpu", fused_shared=True)
    assert [(e["E"], e["M"]) for e in entries] == [(9, 1), (9, 8)]
    for entry in entries:
        check_config("test", MoEConfig.from_dict(entry["config"]), layout="index_gather")
    assert seen and {(k, e) for k, e, _ in seen} == {(3, 9)}
    for _, _, blocks in seen:   # the shared expert's rows: one per token, in every block map timed
        ids = blocks.expert_ids[blocks.expert_ids >= 0]
        assert 8 in ids.tolist()
    with pytest.raises(ValueError, match="one shared expert"):
        tune_module.tune({"small": dataclasses.replace(small, num_shared_experts=0)}, [1], dtype=torch.float32,
                         seed=0, warmup_ms=0, rep_ms=0, workers=0, device="cpu", fused_shared=True)
    # --refine starts from what the fused layer runs today: the fused problem's own lookup, not the E+1 default
    asked, real_choice = [], config_module.choose_fused_shared_config
    monkeypatch.setattr(config_module, "choose_fused_shared_config",
                        lambda *args, **kwargs: (asked.append(args[:2]), real_choice(*args, **kwargs))[1])
    refined = tune_module.tune({"small": small}, [1], dtype=torch.float32, seed=0, warmup_ms=0, rep_ms=0, workers=0,
                               log=lambda line: None, device="cpu", fused_shared=True, refine=True)
    assert [e["E"] for e in refined] == [9] and asked and set(asked) == {(1, 8)}

    # The table these entries make, on an H200, is the one the fused layer takes there.
    monkeypatch.setattr(config_module, "CONFIG_DIR", tmp_path)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: "NVIDIA H200")
    monkeypatch.setattr(tune_tables, "_triton_version", lambda: "3.6.0")
    load_table.cache_clear()
    config_module._cached_choice.cache_clear()
    layer = MoELayer.random(small, dtype=torch.float32, device="cpu", seed=0)
    fused = MoELayer(layer.weights, layer.routing, shared_expert="fused")
    try:
        before = fused.plan(1, device_name="NVIDIA H200").choice
        assert before.source == "default" and ",E=8," in before.asked   # no table at all: the routed lookup's
        tune_tables.write_tables(entries, torch.float32, "results/x/fused.json", "none", lambda *args: None,
                                 fused_shared=True)
        load_table.cache_clear()
        config_module._cached_choice.cache_clear()
        after = fused.plan(1, device_name="NVIDIA H200").choice
        assert after.source == "table" and ",E=9," in after.table and after.entry == 1
        assert layer.plan(1, device_name="NVIDIA H200").choice.source == "default"   # the routed layer: no table
        measured = json.loads(next(tmp_path.glob("*E=9*")).read_text())["measured"]
        assert "--fused-shared" in measured["method"] and "last slot" in measured["routing"]
    finally:
        load_table.cache_clear()
        config_module._cached_choice.cache_clear()


@pytest.mark.parametrize("routed_faster", [True, False])
def test_a_fused_shared_tune_keeps_the_routed_tiles_where_they_ran_faster(monkeypatch, routed_faster):
    """``tune(..., fused_shared=True)`` times its pick as one experts call against the routed table's entry on the
    same fused problem (what the slot runs without an E+1 entry) and writes the routed entry where that was faster:
    on the H100 the margin for machinery had kept plain tiles that cost the layer more than the shared expert's
    whole read. Stand-in timers: the routed tiles' call takes 0.5 or 2.0, everything else 1.0."""
    import dataclasses

    import torch

    from moe_kernels import MODELS
    from moe_kernels.bench import tune as tune_module
    from moe_kernels.bench import tune_candidates
    from moe_kernels.kernels import index_gather
    from moe_kernels.kernels.config import GemmTiles, MoEConfig, get_config

    small = dataclasses.replace(MODELS["deepseek-v3"], hidden_size=64, moe_intermediate_size=32, num_experts=8,
                                top_k=2, num_expert_groups=1, topk_groups=1)
    routed = get_config(1, 8, 32, 64, torch.float32, "cpu")   # (no table on a CPU: the default, 16 x 64 tiles)
    last = {}
    real_run = index_gather.run_experts

    def run(*args, config, **kwargs):
        last["config"] = config
        return real_run(*args, config=config, **kwargs)

    def timed(fn, *args):
        last.pop("config", None)
        fn()
        return (0.5 if routed_faster else 2.0) if last.get("config") == routed else 1.0

    monkeypatch.setattr(index_gather, "run_experts", run)
    monkeypatch.setattr(tune_module, "graphed", lambda fn: fn)
    monkeypatch.setattr(tune_module, "median_ms", timed)
    monkeypatch.setattr(tune_candidates, "tile_candidates", lambda rho, bm, gated, fmt=None: [GemmTiles(16, 32, 1, 4, 2)])
    lines = []
    (entry,) = tune_module.tune({"small": small}, [1], dtype=torch.float32, seed=0, warmup_ms=0, rep_ms=0, workers=0,
                                log=lines.append, device="cpu", fused_shared=True)
    picked = MoEConfig.from_dict(entry["config"])
    assert entry["E"] == 9 and entry["routed_tiles"]["config"] == routed.to_dict()
    assert entry["routed_tiles"]["taken"] == routed_faster and (picked == routed) == routed_faster
    assert entry["routed_tiles"]["ms"] == (0.5 if routed_faster else 2.0) and entry["routed_tiles"]["tuned_ms"] == 1.0
    assert entry["routed_tiles"]["tuned_config"] != routed.to_dict()
    assert "on the routed table's tiles" in lines[-1] and ("(taken" in lines[-1]) == routed_faster
    # Without --fused-shared, and with --refine (which starts from what the slot runs), nothing is compared.
    for options in ({}, {"fused_shared": True, "refine": True}):
        (other,) = tune_module.tune({"small": small}, [1], dtype=torch.float32, seed=0, warmup_ms=0, rep_ms=0,
                                    workers=0, log=lambda line: None, device="cpu", **options)
        assert other["routed_tiles"] is None


@pytest.mark.parametrize("weight_format, batch, naive", [("block", 2, True), ("block", 3, False), ("none", 3, True)])
def test_the_tuner_times_the_block_map_the_layer_runs(monkeypatch, weight_format, batch, naive):
    """Inside vLLM's naive rule (64 experts, top-2: up to 8 tokens) block-fp8 weights leave the naive map from 3
    tokens (``blocks.NAIVE_MAX_TOKENS_BLOCK_FP8``); every block map the tuner times, and every compile job, is the
    one the layer would run. Stand-in timer (the tiles' times do not matter here)."""
    import dataclasses

    import torch

    from moe_kernels import MODELS
    from moe_kernels.bench import tune as tune_module
    from moe_kernels.bench import tune_candidates
    from moe_kernels.kernels import blocks
    from moe_kernels.kernels.config import GemmTiles

    small = dataclasses.replace(MODELS["qwen3-30b-a3b"], hidden_size=128, moe_intermediate_size=128, num_experts=64,
                                top_k=2)
    built, jobs, real = [], [], blocks.assign_blocks

    def assign(*args, **kwargs):
        built.append(kwargs.get("naive"))
        return real(*args, **kwargs)

    monkeypatch.setattr(blocks, "assign_blocks", assign)
    monkeypatch.setattr(tune_module, "graphed", lambda fn: fn)
    monkeypatch.setattr(tune_module, "median_ms", lambda fn, *args: 1.0)
    monkeypatch.setattr(tune_module, "precompile", lambda found, workers, log: jobs.extend(found))
    monkeypatch.setattr(tune_candidates, "tile_candidates",
                        lambda rho, bm, gated, fmt=None: [GemmTiles(16, 128, 1, 4, 2)])
    tune_module.tune({"small": small}, [batch], dtype=torch.float32, seed=0, warmup_ms=0, rep_ms=0, workers=0,
                     log=lambda line: None, device="cpu", weight_format=weight_format)
    assert built and set(built) == {naive}, built
    assert jobs and {job["naive"] for job in jobs} == {naive}


def test_tuning_tries_both_gemms_as_one_stream_on_the_cpu(monkeypatch):
    """``tune`` on a small routed shape, with a stand-in timer under which the streamed pair is the
    fastest experts call: the entry takes ``stream_lag`` (the tuner's lag, GEMM 1's warps or the other
    count), records each stream it timed, and stays a config the layer's lookup accepts."""
    import dataclasses

    import torch

    from moe_kernels import MODELS
    from moe_kernels._runtime import record_launches, use_triton
    from moe_kernels.bench import tune as tune_module
    from moe_kernels.bench import tune_candidates
    from moe_kernels.kernels.config import GemmTiles, MoEConfig, check_config

    if not use_triton(torch.zeros(1)):   # (no Triton, or a GPU machine, where the CPU's tune runs torch references)
        pytest.skip("the torch references launch nothing")
    small = dataclasses.replace(MODELS["qwen3-30b-a3b"], hidden_size=64, moe_intermediate_size=32, num_experts=4,
                                top_k=2)
    calls = iter(range(10**6))

    def timed(fn, *args):   # a stand-in timer: the stream runs fastest, the rest get distinct times
        with record_launches() as launches:
            fn()
        streamed = any(name == "streamed_pair" for name, _ in launches)
        return 0.5 if streamed else 1.0 + (next(calls) % 7) / 10

    monkeypatch.setattr(tune_module, "graphed", lambda fn: fn)
    monkeypatch.setattr(tune_module, "median_ms", timed)
    monkeypatch.setattr(tune_candidates, "tile_candidates", lambda rho, bm, gated, fmt=None: [GemmTiles(16, 32, 1, 4, 2)])
    entries = tune_module.tune({"small": small}, [8], dtype=torch.float32, seed=0, warmup_ms=0, rep_ms=0, workers=0,
                               log=lambda line: None, device="cpu")
    (entry,) = entries
    config = check_config("test", MoEConfig.from_dict(entry["config"]), layout="index_gather")
    assert config.stream_lag == tune_module.STREAM_LAG
    streams = [s for s in entry["experts_ms_by_switches"] if s["stream_lag"] is not None]
    assert sorted(s["gate_up_warps"] for s in streams) == [4, 8] and all(s["ms"] == 0.5 for s in streams)


def test_rewritten_table_keeps_its_notes_on_the_entries_it_keeps(tmp_path, monkeypatch):
    """A tuning run that rewrites some entries of a table keeps the table's notes (changes made after
    an earlier run, each about some token counts) for the entries it keeps, cut to those token counts,
    at the top of the new ``measured`` block, and drops a note whose entries it replaced: a note must
    never end up describing another entry (it once did, inside another run's source group)."""
    import json

    import torch

    import moe_kernels.kernels.config as config_module
    from moe_kernels.bench import tune_tables
    from moe_kernels.kernels.config import GemmTiles, MoEConfig, load_table

    monkeypatch.setattr(config_module, "CONFIG_DIR", tmp_path)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: "NVIDIA H200")
    monkeypatch.setattr(tune_tables, "_triton_version", lambda: "3.6.0")
    load_table.cache_clear()
    plain = MoEConfig(16, GemmTiles(32, 32), GemmTiles(32, 32)).to_dict()
    name = config_module.table_name("NVIDIA H200", 8, 64, 32, torch.bfloat16, "index_gather")
    earlier = {"method": "an earlier run", "record": "results/x/earlier.json", "tuned_token_counts": [256, 512],
               "stream": {"tokens": [256, 512], "change": "stream_lag 32"},
               "prefill": {"tokens": [1024], "change": "64-row tiles"}, "k512": {"tokens": [512], "change": "K 128"}}
    (tmp_path / f"{name}.json").write_text(json.dumps(
        {"measured": earlier, "configs": {str(m): plain for m in (1, 256, 512, 1024)}}))
    entries = [{"E": 8, "N": 64, "K": 32, "M": m, "config": plain} for m in (1, 512)]
    tune_tables.write_tables(entries, torch.bfloat16, "results/x/new.json", "none", lambda *args: None)
    measured = json.loads((tmp_path / f"{name}.json").read_text())["measured"]
    load_table.cache_clear()
    assert measured["tuned_token_counts"] == [1, 512]
    assert measured["stream"] == {"tokens": [256], "change": "stream_lag 32"}
    assert measured["prefill"] == {"tokens": [1024], "change": "64-row tiles"} and "k512" not in measured
    groups = {tuple(group["tokens"]): group["measured"] for group in measured["other_token_counts"]}
    assert set(groups) == {(256,), (1024,)}
    assert all(not tune_tables.is_note(value) for block in groups.values() for value in block.values())


def test_a_tool_record_comes_back_with_its_provenance(tmp_path, monkeypatch):
    """record_tool writes the record under results/ and, in a device run ($OUT set), the same file
    into $OUT, provenance included: what comes back from the device is the record, not rows alone."""
    import json

    from moe_kernels import results

    monkeypatch.setattr(results, "RESULTS_DIR", tmp_path / "results")
    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.setenv("MOE_KERNELS_COMMIT", "0" * 40)
    path = results.record_tool("some-ab", [{"us": 1.0}], {"batches": [8]})
    back = json.loads((tmp_path / "some-ab.json").read_text())
    assert back == json.loads(path.read_text()) and path.parent.parent == tmp_path / "results"
    assert back["data"] == {"rows": [{"us": 1.0}], "config": {"batches": [8]}}
    assert back["provenance"]["git_commit"] == "0" * 40
