#!/usr/bin/env python
"""Parity of tpcore at every world size: the same as `python -m tpcore.bench parity`.

    python benchmarks/parity.py --checkpoint DIR --worlds 1,2,4
    python benchmarks/parity.py --checkpoint DIR --text FILE --json parity.json --plot parity.png

See `python benchmarks/parity.py --help` for the columns and the method.
"""
import os
import sys

try:
    import tpcore.bench  # noqa: F401 (only whether tpcore is importable)
except ImportError:  # run from a source checkout that is not installed (the extension must be built)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

from tpcore.bench.__main__ import main

if __name__ == "__main__":
    sys.exit(main(["parity", *sys.argv[1:]]))
