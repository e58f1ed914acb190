"""Runs the side-by-side benchmark (same as `mmproxy bench`); see BENCHMARKS.md for the commands."""

import sys

from mmproxy.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
