"""The disk tier's reader alone vs a plain sequential read: same as `everybyte bench disk-reader`."""
import sys

from everybyte.bench.micro.disk_reader import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
