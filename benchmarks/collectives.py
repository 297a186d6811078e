#!/usr/bin/env python
"""Collectives benchmark of tpcore: the same as `python -m tpcore.bench collectives`.

    python benchmarks/collectives.py -n 2 --quick
    python benchmarks/collectives.py -n 2 --max-bytes 256M --json out.json --plot out.png

See `python benchmarks/collectives.py --help` for the columns and the method.
"""
import os
import sys

try:
    import tpcore.bench  # noqa: F401 (only whether tpcore is importable)
except ImportError:  # run from a source checkout that is not installed (the extension must be built)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

from tpcore.bench.__main__ import main

if __name__ == "__main__":
    sys.exit(main(["collectives", *sys.argv[1:]]))
