"""The markdown table of `ringserve compile --json` reports (bench/results/compile/*.json, made by
bench/results/compile/run.sh) for bench/RESULTS.md: per program whether it compiled, in how long,
its memory per chip, its collectives per layer and its analytic step (labelled an estimate).

    python -m ringserve.bench.compile_table bench/results/compile/*.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

GIB = 1 << 30


def _model(model: str) -> str:
    """A named shape as it is; a checkpoint's config.json by its directory ("tiny gemma2")."""
    if "/" not in model:
        return model
    path = Path(model.split()[-1])
    return path.parent.name if path.name == "config.json" else path.name


def rows(paths: list[str]) -> list[str]:
    out = [
        "| topology (tp) | model | program | compiled | s | args GiB/chip | temp GiB/chip | collectives/layer "
        "(+ outside) | bytes read/chip | est. step ms (HBM / MXU / ICI) | bound | est. tok/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for path in paths:
        for p in json.loads(Path(path).read_text()):
            e, m = p["estimate"], p["memory"]
            name = f"{p['family']} T={p['tokens']} R={p['rows']}"
            coll = ", ".join(f"{k} {v}" for k, v in p["collectives_per_layer"].items()) or "-"
            if p["collectives_outside_layers"]:
                coll += (
                    " (+ " + ", ".join(f"{k} {v}" for k, v in p["collectives_outside_layers"].items()) + ")"
                )
            ok = "ok" if p["ok"] else "FAIL: " + (p["error"] or "").splitlines()[0][:120].replace("|", "/")
            tps = f"{e['tokens_per_s']:,.0f}" if e.get("tokens_per_s") else "-"
            out.append(
                f"| {p['topology']} ({p['tp_size']}) | {_model(p['model'])} "
                f"| {name} | {ok} | {p['seconds']:.0f} | {m.get('argument', 0) / GIB:.2f} | {m.get('temp', 0) / GIB:.2f} "
                f"| {coll} | {e['bytes_per_chip'] / 1e9:.2f} GB | {e['step_s'] * 1e3:.2f} ({e['hbm_s'] * 1e3:.2f} / "
                f"{e['mxu_s'] * 1e3:.2f} / {e['ici_s'] * 1e3:.2f}) | {e['bound']} | {tps} |"
            )
    return out


if __name__ == "__main__":
    print("\n".join(rows(sys.argv[1:])))
