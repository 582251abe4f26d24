"""Perplexity and speed per KV cache format: same as `everybyte bench kv-quality`."""
import sys

from everybyte.bench.micro.kv_quality import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
