"""Where the tuner's margin for machinery kept a plain tile in today's tables, and what that cost by the tuner's own
timings: a read of the committed tuning records, with no GPU.

``bench tune`` takes a candidate with machinery (TMA, split-K, a persistent grid, the transposed product) only when
it beats the best plain tile by more than ``MACHINERY_MARGIN`` (3%, about one timing's spread). In session 44 that
margin, applied to GEMM 1's milliseconds, outweighed the whole of a shared expert's floor. This tool lists every
entry of the index-gather tables whose GEMM is still the plain tile a record chose that way, with the faster
candidate the same record timed beside it (same GEMM, same M tile, and for GEMM 2 the same top-k sum), so that a
whole-layer A/B can decide the ones that matter: one line per table entry and GEMM, from the newest record that
timed it. Records from before a table was re-tuned or copied do not match its tiles and are left out. A line
marked "over the margin" was chosen by another rule: the entry's whole-call A/B of its switches (PDL, quantising in
GEMM 1), or the tuner of the record's day.

    python tools/margin_audit.py            # one line per entry, the largest cost in microseconds first
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from moe_kernels.bench.tune_candidates import MACHINERY_MARGIN  # noqa: E402

SHOWN = ("block_n", "num_warps", "num_stages", "split_k", "tma", "persistent", "swap_ab")


def tables() -> dict:
    """(device name, E, N, K, dtype) -> the table's entries, for every index-gather table in the package."""
    found = {}
    for path in (ROOT / "moe_kernels" / "kernels" / "configs").glob("*layout=index_gather.json"):
        fields = dict(part.split("=") for part in path.stem.split(","))
        key = (fields["device"].replace("_", " "), int(fields["E"]), int(fields["N"]), int(fields["K"]),
               fields["dtype"])
        found[key] = json.loads(path.read_text())["configs"]
    return found


def plain(tiles: dict) -> bool:
    """The tuner's plain tile (``tune_candidates.plain_tiles``) on a record's dict; older records lack some keys."""
    return (tiles.get("split_k", 1) == 1 and not tiles.get("tma") and not tiles.get("persistent")
            and not tiles.get("swap_ab"))


def kept_by_margin():
    """One dict per (table, entry, GEMM) whose chosen tile is plain, in today's table, and slower than the fastest
    candidate a record timed for that GEMM and M tile (the newest such record)."""
    current, newest = tables(), {}
    for record in sorted((ROOT / "results").glob("*/*.json")):
        try:
            whole = json.loads(record.read_text())
            data, date = whole.get("data"), whole.get("provenance", {}).get("date_utc", "")
        except (ValueError, AttributeError):
            continue
        if not isinstance(data, dict) or "entries" not in data or "device" not in data:
            continue
        for entry in data["entries"]:
            if "tried" not in entry or "config" not in entry:
                continue
            fp8 = entry.get("format") in ("block", "channel")   # (bf16 records say "none")
            dtype = "float8_e4m3fn" if fp8 else "bfloat16"
            table = current.get((data["device"], entry["E"], entry["N"], entry["K"], dtype), {})
            in_table = table.get(str(entry["M"]))
            block_m = entry["config"]["block_m"]
            for gemm in ("gate_up", "down"):
                chosen = entry["config"][gemm]
                if (not plain(chosen) or not in_table or in_table.get("block_m") != block_m
                        or in_table.get(gemm) != chosen):
                    continue
                summed = entry["config"].get("sum_in_gemm", False) if gemm == "down" else None
                timed = [t for t in entry["tried"] if t.get("gemm") == gemm and t.get("block_m") == block_m
                         and t.get("ms") and (summed is None or t.get("sum_in_gemm", False) == summed)]
                mine = [t["ms"] for t in timed if t["tiles"] == chosen]
                fastest = min(timed, key=lambda t: t["ms"], default=None)
                if not mine or fastest is None or plain(fastest["tiles"]) or fastest["ms"] >= mine[0]:
                    continue
                key = (data["device"], entry["E"], entry["N"], entry["K"], dtype, entry["M"], gemm)
                if key in newest and newest[key][0] > date:
                    continue
                newest[key] = date, {"record": f"{record.parent.name}/{record.name}", "model": entry.get("model"),
                       "format": entry["format"] if fp8 else "bf16", "E": entry["E"], "tokens": entry["M"],
                       "gemm": gemm,
                       "chosen_us": mine[0] * 1e3, "fastest_us": fastest["ms"] * 1e3,
                       "fastest": {k: fastest["tiles"][k] for k in SHOWN if k in fastest["tiles"]}}
    yield from (row for _, row in newest.values())


def main() -> int:
    rows = sorted(kept_by_margin(), key=lambda r: r["fastest_us"] - r["chosen_us"])
    print(f"plain tiles kept by the {MACHINERY_MARGIN:.0%} margin, in today's tables ({len(rows)}):")
    for r in rows:
        gap = r["chosen_us"] - r["fastest_us"]
        print(f"{r['record']:<62} {r['model']:<14} {r['format']:<5} E={r['E']:<3} {r['tokens']:>5} tokens "
              f"{r['gemm']:<7} {r['chosen_us']:8.1f} us, fastest {r['fastest_us']:8.1f} "
              f"(+{gap:5.1f} us, {gap / r['fastest_us']:5.1%}) {r['fastest']}"
              + (" over the margin: another rule" if gap > r["fastest_us"] * MACHINERY_MARGIN else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
