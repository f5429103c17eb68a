"""`ringserve models`: the model families ringserve serves, by HF architecture, and what each
supports (model/families/: the registry loading, make-tiny-model, PEFT, GGUF and int8 consult)."""

from __future__ import annotations

import argparse
import json
import sys


def rows() -> list[dict]:
    """One row per HF architecture: its family and the family's capabilities."""
    from ringserve.model.families import ARCHITECTURES

    return [{"architecture": arch, "family": f.name, "summary": f.summary, **f.capabilities}
            for arch, f in ARCHITECTURES.items()]  # fmt: skip


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="ringserve models", description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="print the table as JSON (one object per architecture)")
    args = ap.parse_args(argv)
    table = rows()
    if args.json:
        print(json.dumps(table, indent=2))
        return 0
    head = ("architecture", "family", "tp", "MoE", "LoRA", "int8", "GGUF", "attention")
    lines = [head] + [(r["architecture"], r["family"], _yes(r["tp"]), _yes(r["moe"]), _lora(r), _yes(r["int8"]),
                       r["gguf"] or "-", "/".join(p.upper() for p in r["attention"])) for r in table]  # fmt: skip
    width = [max(len(str(line[i])) for line in lines) for i in range(len(head))]
    for line in lines:
        print("  ".join(str(c).ljust(w) for c, w in zip(line, width, strict=True)).rstrip())
    print()
    for r in table:
        print(f"{r['architecture']}: {r['summary']}")
    print("\nmake-tiny-model --arch takes a family's name; a .gguf of a GGUF column's llama.cpp architecture loads "
          "directly (dequantized).", file=sys.stderr)  # fmt: skip
    return 0


def _yes(v: bool) -> str:
    return "yes" if v else "-"


def _lora(r: dict) -> str:
    """LoRA's column: "attn" where adapters train attention alone (a MoE family's experts take none)."""
    return "attn" if r["lora"] and r["moe"] else _yes(r["lora"])
