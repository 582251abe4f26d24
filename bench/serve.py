"""HTTP vs in-process throughput: same as `everybyte bench serve`."""
import sys

from everybyte.bench.serve import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
