"""``python -m moe_kernels.bench <command> [options]``: every measurement, one entry point."""

from __future__ import annotations

import difflib
import importlib
import sys

#: command -> (module, what it measures)
COMMANDS = {
    "sweep": ("sweep", "the MoE layer, batch 1..16384, every layout and baseline, time over the floor"),
    "tune": ("tune", "search tile configurations and write the tuned tables (kernels/configs/*.json)"),
    "layouts": ("layouts", "per-stage CUDA-graph times of the three layouts"),
    "routing": ("routing", "routing and alignment kernels against their torch references"),
    "skew": ("skew", "index-gather vs masked GEMMs under Zipf-skewed routing"),
    "capacity": ("capacity", "a capacity-factor layer's static [E, C] GEMMs against the dropless layer's"),
    "shared": ("shared", "the shared expert as a separate FFN vs fused as slot E"),
    "fp8": ("fp8", "fp8 W8A8 experts (block, channel) against bf16 and torch's fp8 grouped GEMM"),
    "decode-step": ("decode_step", "one DeepSeek-V3 layer at 64 tokens, stage by stage (--fp8: also fp8)"),
    "ceilings": ("ceilings", "HBM bandwidth and GEMM rates"),
    "layer": ("layer_cost", "host and GPU time per call of fused_experts and MoELayer, the id check's cost"),
    "model": ("model_step", "a whole transformers model's decode step with each experts implementation"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        _usage()
        return 0
    if not argv or argv[0] not in COMMANDS:
        if argv:
            close = difflib.get_close_matches(argv[0], COMMANDS, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            print(f"moe_kernels.bench: unknown command {argv[0]!r}{hint}", file=sys.stderr)
        _usage()
        return 2
    module = importlib.import_module(f"moe_kernels.bench.{COMMANDS[argv[0]][0]}")
    return module.main(argv[1:])


def _usage() -> None:
    width = max(map(len, COMMANDS))
    print("usage: python -m moe_kernels.bench <command> [options]   (each command has --help)\n")
    for name, (_, what) in COMMANDS.items():
        print(f"  {name:<{width}}  {what}")


if __name__ == "__main__":
    sys.exit(main())
