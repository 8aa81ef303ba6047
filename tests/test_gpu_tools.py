"""The GPU experiments in tools/ that the next device session runs, checked here without one: their
kernels compute the right values under the interpreter, and compile for Hopper (sm_90) as the
experiment needs them to (the tile reader's loads through a cp.async pipeline; the launch chain's
programmatic-dependent-launch instructions). A tool that fails on the device costs a session's
GPU minutes; these cost seconds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run_tool(code_or_path, *, interpret: bool, timeout=600, env: dict | None = None):
    env = {**{k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "MOE_KERNELS_BACKEND")},
           **(env or {})}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), str(ROOT)) if p)
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    args = [sys.executable, str(code_or_path)] if isinstance(code_or_path, Path) else [sys.executable, "-c", code_or_path]
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


@pytest.mark.parametrize("tool, says", [("launch_floor.py", "chain values correct"),
                                        ("tile_read_ab.py", "tile sums correct"), ("l2_read.py", "read sums correct"),
                                        ("l2_flush_ab.py", "payloads ran once")])
def test_the_tools_compute_their_values_without_a_gpu(tool, says):
    pytest.importorskip("triton")
    done = run_tool(ROOT / "tools" / tool, interpret=True)
    assert done.returncode == 0 and says in done.stdout, done.stderr[-3000:]


_COMPILE_TOOLS_FOR_HOPPER = """
import importlib.util, re
import torch
torch.cuda.is_available = lambda: True   # build compiled (not interpreted) kernels; nothing is launched
from moe_kernels.sm90_compile import compile_for_sm90


def tool(name):
    spec = importlib.util.spec_from_file_location(name, f"tools/{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


reader = tool("tile_read_ab")
for gated in (False, True):
    for dtype, size in (("bf16", 2), ("fp8e4nv", 1)):
        tiles = reader.candidates(gated, size)
        biggest = max(tiles, key=lambda c: reader.shared_bytes(gated, c["block_n"], c["block_k"], c["stages"], size))
        for c in (biggest, next(c for c in tiles if not c["dot"])):
            k = compile_for_sm90(reader._tile_read, {"GATED": gated, "BLOCK_N": c["block_n"], "BLOCK_K": c["block_k"],
                                                     "STAGES": c["stages"], "DOT": c["dot"]},
                                 {"w_ptr": "*" + dtype, "a_ptr": "*" + dtype, "out_ptr": "*fp32"},
                                 aligned=("N", "K", "stride_e"), num_warps=c["warps"])
            ptx = k.asm["ptx"]
            predicted = reader.shared_bytes(gated, c["block_n"], c["block_k"], c["stages"], size)
            print(gated, dtype, c["dot"], "cp.async.cg" in ptx, "mma.sync" in ptx,
                  k.metadata.shared <= min(predicted, reader.SHARED_BYTES))
chain = tool("launch_floor")
for pdl in (False, True):
    ptx = compile_for_sm90(chain._add_one, {"PDL": pdl, "BLOCK": 128}, {"x_ptr": "*fp32", "y_ptr": "*fp32"},
                           num_warps=4, launch_pdl=pdl).asm["ptx"]
    print("pdl", pdl, "griddepcontrol.wait" in ptx, "griddepcontrol.launch_dependents" in ptx)
"""


def test_the_tools_kernels_compile_for_hopper_as_the_experiments_need():
    """The tile reader streams through the GEMM's cp.async pipeline (with and without its 16-row
    mma.sync), gated or not, and its largest candidate fits the shared memory the tool predicts (and
    an SM has); the launch chain's PDL variant waits on and releases the next kernel."""
    pytest.importorskip("triton.backends.nvidia")
    done = run_tool(_COMPILE_TOOLS_FOR_HOPPER, interpret=False)
    assert done.returncode == 0, done.stderr[-3000:]
    expected = [f"{gated} {dtype} {dot} True {dot} True" for gated in (False, True) for dtype in ("bf16", "fp8e4nv")
                for dot in (True, False)]
    assert done.stdout.split("\n")[:10] == expected + ["pdl False False False", "pdl True True True"], done.stdout


_COMPILE_GLUON_FOR_HOPPER = """
import runpy, sys
sys.argv = ["tools/gluon_block_fp8_ab.py", "--compile-only"]
runpy.run_path("tools/gluon_block_fp8_ab.py", run_name="__main__")
"""


def test_gluon_block_fp8_compiles_for_hopper():
    """The Gluon block-fp8 GEMM (kernels/gluon_block_fp8.py, built by tools/gluon_block_fp8_ab.py) builds
    for sm_90a in both orders, 8 warps, BLOCK_N 128 and 64, plain and gated (SiLU·mul in the epilogue), one
    program a tile with half tiles, and on its persistent grid (128 columns, overlapped; gated also quantising its
    output, plain also storing by TMA; each with half tiles, whose
    wgmmas are m64 n64 beside the whole tiles' n128), and transposed (decode, fp8 and bf16: 128 weight rows by
    16, 32 or 64 tokens, wgmma's N the tokens, at the warps the kernel takes and 16 tokens at 8 warps; fp8 GEMM 1
    also quantising its output): the
    overlapped one waits with one MMA outstanding (``wgmma.wait_group 1``, the promotion under the next
    MMA), the in-order one never does; none spills, and ptxas serialises none's wgmmas. Gluon's API is Triton 3.6's here (CI's ``.ci-triton36``): other Triton skips."""
    import re

    triton = pytest.importorskip("triton")
    if not triton.__version__.startswith("3.6."):
        pytest.skip(f"the tool is written for Triton 3.6's Gluon API (this is Triton {triton.__version__})")
    pytest.importorskip("triton.experimental.gluon")
    pytest.importorskip("triton.backends.nvidia")
    done = run_tool(_COMPILE_GLUON_FOR_HOPPER, interpret=False)
    assert done.returncode == 0, done.stderr[-3000:]
    builds = re.findall(r"^((?:gated )?(?:persistent )?(?:quantising )?(?:half )?(?:tma store )?(?:overlap|in-order)) "
                        r"block_n=(\d+) "
                        r".*?wgmma \d+ \(n ([\d,]+)\), waits ([\d,]+), "
                        r"registers \d+, spills (\d+)/(\d+) .*ptxas wgmma warnings (\d+)$", done.stdout, re.M)
    assert sorted((order, n) for order, n, *_ in builds) == sorted(
        [(gated + order, n) for gated in ("", "gated ") for order in ("overlap", "in-order") for n in ("128", "64")]
        + [(gated + "half overlap", "128") for gated in ("", "gated ")]
        + [(gated + "persistent " + half + "overlap", "128") for gated in ("", "gated ") for half in ("", "half ")]
        + [("persistent " + half + "tma store overlap", "128") for half in ("", "half ")]
        + [("gated persistent quantising " + half + "overlap", "128") for half in ("", "half ")]), done.stdout
    transposed = re.findall(r"^((?:bf16 )?(?:gated )?(?:quantising )?)transposed block_t=(\d+) warps=(\d) .*?\(n (\d+)\), waits ([\d,]+), "
                            r"registers \d+, spills (\d+)/(\d+) .*ptxas wgmma warnings (\d+)$", done.stdout, re.M)
    settings = (("16", "4"), ("32", "4"), ("64", "8"), ("16", "8"))   # (block_t, warps)
    kinds = ("", "gated ", "gated quantising ", "bf16 ", "bf16 gated ")
    assert sorted(t[:3] for t in transposed) == sorted((kind, t, w) for kind in kinds for t, w in settings), done.stdout
    for _, block_t, _, n, waits, *clean in transposed:   # tokens on wgmma's N side; the promotion overlapped
        assert n == block_t and {int(w) for w in waits.split(",")} == {0, 1} and clean == ["0", "0", "0"], done.stdout
    for order, block_n, shapes, waits, spill_stores, spill_loads, warnings in builds:
        # a half tile's wgmmas: the two warpgroups side by side, m64 n(block_n / 2) each; whole tiles m64 n(block_n)
        assert shapes == (f"{block_n},{int(block_n) // 2}" if "half " in order else block_n), done.stdout
        for prefix in ("gated ", "persistent ", "quantising ", "half ", "tma store "):
            order = order.removeprefix(prefix)
        waits = {int(w) for w in waits.split(",")}
        assert (1 in waits) == (order == "overlap") and 0 in waits, done.stdout
        assert (spill_stores, spill_loads, warnings) == ("0", "0", "0"), done.stdout


@pytest.mark.parametrize("tokens, prefix", [("1", ""), ("128", "E=1 ")], ids=["every table at 1", "E=1 at 128"])
def test_table_audit_compiles_every_table_for_hopper(tokens, prefix):
    """tools/table_audit.py compiles each table's entry for sm_90 and says what the compiler made of it: one line
    per table, no spill. At one token every table (the routed ones on the naive map; the shared experts' E=1 tables
    on the dense block map); at 128 the E=1 tables, whose H100 fp8 entry there is the only persistent, transposed
    TMA tile on the dense map. With the H200's Triton, 3.6 (CI's ``.ci-triton36``): another's bundled ptxas may not
    read its own PTX (3.9's, here)."""
    triton = pytest.importorskip("triton")
    if not triton.__version__.startswith("3.6."):
        pytest.skip(f"the audit reads the H200's Triton, 3.6 (this is Triton {triton.__version__})")
    pytest.importorskip("triton.backends.nvidia")
    done = run_tool(f"import runpy, sys; sys.argv = ['tools/table_audit.py', '{tokens}', '{prefix}']; "
                    "runpy.run_path('tools/table_audit.py', run_name='__main__')", interpret=False)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stdout.split("\n") if line.startswith("E=")]
    tables = [json.loads(p.read_text())["configs"]
              for p in (ROOT / "moe_kernels" / "kernels" / "configs").glob("*layout=index_gather.json")
              if not prefix or f",{prefix.strip()}," in p.name]
    assert len(lines) == sum(tokens in table for table in tables) >= 3, done.stdout
    assert all(" gate " in line and " down " in line for line in lines), done.stdout
    assert not any("spills" in line for line in lines), done.stdout
    if prefix:   # the H100's persistent transposed entry: wgmma through TMA, its tile and K loops nested
        line = next(line for line in lines if line.startswith("E=1 fp8 (H100)"))
        assert "gate wgmma    QGMMA" in line and "4xTMA      2" in line, line


def test_margin_audit_lists_only_plain_picks_still_in_the_tables():
    """tools/margin_audit.py reads the committed tuning records: each line it yields is a GEMM whose table entry
    is, today, the plain tile a record chose within the machinery margin, slower than a machinery tile that record
    timed (a table re-tuned since, or a machinery pick, is not listed), once per entry and GEMM."""
    import importlib.util
    import json

    spec = importlib.util.spec_from_file_location("margin_audit", ROOT / "tools" / "margin_audit.py")
    audit = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(audit)
    from moe_kernels.bench.tune_candidates import plain_tiles
    from moe_kernels.kernels.config import GemmTiles

    tables = audit.tables()
    rows = list(audit.kept_by_margin())
    entries = [(r["record"].split("/")[0], r["E"], r["format"], r["tokens"], r["gemm"]) for r in rows]
    assert rows and len(set(entries)) == len(entries)   # (one line per table entry and GEMM)
    for row in rows:
        assert row["fastest_us"] < row["chosen_us"] and not audit.plain(row["fastest"]), row
        device = json.loads((ROOT / "results" / row["record"]).read_text())["data"]["device"]
        dtype = "bfloat16" if row["format"] == "bf16" else "float8_e4m3fn"
        entries = [t for k, t in tables.items() if k[0] == device and k[1] == row["E"] and k[4] == dtype]
        tiles = entries[0][str(row["tokens"])][row["gemm"]]
        assert plain_tiles(GemmTiles(**tiles)), (row, tiles)
    done = run_tool(ROOT / "tools" / "margin_audit.py", interpret=False)
    assert done.returncode == 0 and f"({len(rows)}):" in done.stdout, done.stderr[-3000:]


def test_stage_depth_ab_plans_only_variants_that_fit_and_differ():
    """tools/stage_depth_ab.py times a table entry against itself with other pipeline depths, M tiles, warps and
    the transposed product: every variant differs from the entry, fits in shared memory by the tuner's rule (depths
    that do not are left out), holds the values its name gives and changes nothing else; an entry with a stream lag
    (one kernel on GEMM 1's stages and warps) varies GEMM 1's only. Without a GPU the tool prints a plan."""
    import dataclasses
    import importlib.util

    spec = importlib.util.spec_from_file_location("stage_depth_ab", ROOT / "tools" / "stage_depth_ab.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    from moe_kernels.bench.tune_candidates import fits
    from moe_kernels.kernels.config import GemmTiles, MoEConfig
    from moe_kernels.kernels.formats import FORMATS

    entry = MoEConfig(32, GemmTiles(64, 128, num_warps=4, num_stages=3, swap_ab=True),
                      GemmTiles(256, 128, num_warps=8, num_stages=3, tma=True, swap_ab=True))
    plain = dataclasses.replace(entry, gate_up=GemmTiles(64, 128, num_warps=8, num_stages=5))
    fp8 = FORMATS["block"]
    assert not fits(32, 256, 128, 7, False, fp8)   # (so GEMM 2 on 7 stages must be dropped below)
    for config in (entry, plain):
        found = tool.variants(config, fp8, [3, 4, 5, 6, 7], [16, 32, 64], [4, 8], swap=True)
        assert found["table"] == config and len(set(map(repr, found.values()))) == len(found)
        assert not any(v.down.num_stages == 7 for v in found.values()) and "stages 7/3" in found
        for name, variant in found.items():
            kind, _, rest = name.partition(" ")
            g1, g2 = variant.gate_up, variant.down
            if kind in ("stages", "warps"):   # "stages 4/5": GEMM 1's 4, GEMM 2's 5, and nothing else changed
                field = {"stages": "num_stages", "warps": "num_warps"}[kind]
                want = [int(v) for v in rest.split("/")]
                assert [getattr(g1, field), getattr(g2, field)] == want, name
                assert variant == dataclasses.replace(
                    config, gate_up=dataclasses.replace(config.gate_up, **{field: want[0]}),
                    down=dataclasses.replace(config.down, **{field: want[1]})) != config, name
            elif kind == "block_m":
                assert variant == dataclasses.replace(config, block_m=int(rest)) != config, name
            elif kind == "swap":
                tiles = getattr(config, rest)
                assert not tiles.swap_ab and variant == dataclasses.replace(
                    config, **{rest: dataclasses.replace(tiles, swap_ab=True, tma=True)}), name
            else:
                assert name == "table", name
            for tiles, gated in ((g1, True), (g2, False)):
                assert fits(variant.block_m, tiles.block_n, tiles.block_k, tiles.num_stages, gated, fp8), name
    assert "swap gate_up" in tool.variants(plain, fp8, [3], [], swap=True)
    assert not any(n.startswith("swap") for n in tool.variants(entry, fp8, [3], [], swap=True))
    streamed = dataclasses.replace(entry, stream_lag=32)
    found = tool.variants(streamed, fp8, [3, 4, 5], [], [4, 8])
    assert found and all(v.down == entry.down for v in found.values()) and "stages 4/3" in found
    assert tool.tiles_text(streamed).endswith(" stream lag 32")
    # STAGE_AB_SET: named variants, each the entry with the fields it names changed and nothing else.
    named = tool.set_variants(entry, "down.persistent=1; sum_in_gemm=true,down.block_n=128; down.tma=true; ")
    assert list(named) == ["down.persistent=1", "sum_in_gemm=true,down.block_n=128"]   # (tma: the entry's own)
    assert named["down.persistent=1"] == dataclasses.replace(entry, down=dataclasses.replace(entry.down, persistent=1))
    assert named["sum_in_gemm=true,down.block_n=128"] == dataclasses.replace(
        entry, sum_in_gemm=True, down=dataclasses.replace(entry.down, block_n=128))
    assert tool.set_variants(entry, "stream_lag=32")["stream_lag=32"] == streamed
    # a config named twice is timed once, under its first name (stream_lag=null on an entry that does not stream)
    twice = tool.set_variants(entry, "down.persistent=1;stream_lag=null,down.persistent=1;stream_lag=null")
    assert list(twice) == ["down.persistent=1", "stream_lag=null,down.persistent=1"]
    assert list(tool.distinct({"table": entry, **twice})) == ["table", "down.persistent=1"]
    for bad, says in (("down.blockn=64", "'down.blockn' is not a field"), ("persistent", "must be field=value"),
                      ("up.block_n=64", "must be field=value"), ("down.persistent=3", "persistent")):
        with pytest.raises((ValueError, TypeError), match=says):
            tool.set_variants(entry, bad)
    done = run_tool("import runpy, sys; sys.argv = ['tools/stage_depth_ab.py', 'qwen3-30b-a3b', 'block', '8']; "
                    "runpy.run_path('tools/stage_depth_ab.py', run_name='__main__')", interpret=True,
                    env={"STAGE_AB_SET": "down.num_warps=8;pdl=true"})
    assert done.returncode == 0 and "qwen3-30b-a3b block 8: table" in done.stdout, done.stderr[-3000:]
    assert "8: pdl=true" in done.stdout and "8: down.num_warps=8" in done.stdout, done.stdout


def test_the_decode_tools_take_the_block_map_the_layer_takes():
    """``bench.problems.tool_blocks`` (the decode A/B tools' block map) follows the layer's rule: vLLM's naive map
    for 16-bit weights up to T * k * 4 <= E, block-fp8 weights only up to ``NAIVE_MAX_TOKENS_BLOCK_FP8`` tokens
    (DeepSeek-V3's 256 experts: naive up to 8 tokens in bf16, 2 in block fp8)."""
    import torch

    from moe_kernels.bench.problems import tool_blocks
    from moe_kernels.kernels.blocks import NAIVE_MAX_TOKENS_BLOCK_FP8
    from moe_kernels.kernels.formats import FORMATS
    from moe_kernels.model.shapes import MODELS

    model = MODELS["deepseek-v3"]
    for tokens in (1, 2, 3, 8, 9):
        ids = torch.stack([torch.randperm(model.num_experts)[:model.top_k] for _ in range(tokens)]).to(torch.int32)
        for fmt, naive_up_to in (("none", 8), ("block", NAIVE_MAX_TOKENS_BLOCK_FP8)):
            blocks = tool_blocks(ids, 16, model, FORMATS[fmt])
            assert (blocks.sorted_token_ids is None) == (tokens <= naive_up_to), (fmt, tokens)


def test_decode_ncu_reads_nsight_computes_csv_into_a_record(tmp_path):
    """tools/decode_ncu.py --record: each kernel of ncu's CSV (after its preamble) with its values converted from the
    units ncu gave them (ns or ms, byte or Gbyte), every stall reason kept; the provenance is that of a record the
    same device call wrote, named in it."""
    rows = ['"ID","Kernel Name","Metric Name","Metric Unit","Metric Value"',
            '"0","_index_gather_gemm_kernel","Duration","ms","1.28"',
            '"0","_index_gather_gemm_kernel","dram__bytes_read.sum","Gbyte","3.77"',
            '"0","_index_gather_gemm_kernel","smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio",'
            '"","3.5"',
            '"1","_moe_sum_kernel","Duration","ns","24,256"', '"1","_moe_sum_kernel","DRAM Throughput","%","77.8"']
    (tmp_path / "k.csv").write_text("==PROF== Connected\nprinted by the program\n" + "\n".join(rows) + "\n")
    sibling = tmp_path / "call.json"
    sibling.write_text(json.dumps({"provenance": {"device": "NVIDIA H100 80GB HBM3", "git_commit": "abc"}, "data": {}}))
    done = run_tool(f"import runpy, sys; sys.argv = ['decode_ncu.py', '--record', 'ncu-x', {str(sibling)!r}, "
                    f"'fp8={tmp_path / 'k.csv'}']; runpy.run_path('tools/decode_ncu.py', run_name='__main__')",
                    interpret=True)
    assert done.returncode == 0, done.stderr[-3000:]
    rec = json.loads((tmp_path / "ncu-x.json").read_text())
    assert rec["provenance"]["git_commit"] == "abc" and rec["provenance"]["provenance_from"] == str(sibling)
    gemm, total = rec["data"]["kernels"]["fp8"]
    assert (gemm["time_us"], gemm["read_bytes"], gemm["stalls"]) == (1280.0, 3.77e9, {"barrier": 3.5})
    assert (total["name"], total["time_us"], total["dram_pct"], total["read_bytes"]) == ("_moe_sum_kernel", 24.256,
                                                                                        77.8, None)
