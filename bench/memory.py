"""The memory levers off, each alone and all together on one agentic replay: same as `everybyte bench memory`."""
import sys

from everybyte.bench.micro.memory import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
