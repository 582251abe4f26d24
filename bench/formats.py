"""NVFP4/FP8 codec throughput vs copy bandwidth: same as `everybyte bench formats`."""
import sys

from everybyte.bench.micro.formats import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
