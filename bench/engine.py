"""Prefill and decode tokens/s vs transformers: same as `everybyte bench engine`."""
import sys

from everybyte.bench.engine import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
