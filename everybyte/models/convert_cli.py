"""`everybyte convert [MODEL] --to hf DIR`: write a model everybyte loads in another format."""
from __future__ import annotations

import argparse
import sys

from everybyte.models.hf_export import FORMATS

PROG = "everybyte convert"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split(": ", 1)[1])
    p.add_argument("model", nargs="?", default=None,
                   help="a GGUF file or Hugging Face directory (default: the embedded default model)")
    p.add_argument("--to", nargs=2, required=True, metavar=("FORMAT", "DIR"),
                   help=f"output format ({', '.join(FORMATS)}) and directory")
    p.add_argument("--dtype", default="bf16", choices=("fp32", "fp16", "bf16"), help="weight dtype written")
    p.add_argument("--force", action="store_true", help="replace DIR when it exists and is not empty")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    fmt, out = args.to
    if fmt not in FORMATS:
        print(f"{PROG}: error: unknown --to format {fmt!r}; choose from {', '.join(FORMATS)}", file=sys.stderr)
        return 2
    from everybyte.models.hf_export import export_hf
    try:
        path = export_hf(args.model, out, dtype=args.dtype, force=args.force)
    except (OSError, ValueError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    print(path)
    return 0
