#!/usr/bin/env python
"""Serving benchmark of tpcore (continuous batching): the same as `python -m tpcore.bench serve`.

    python benchmarks/serve.py --quick
    python benchmarks/serve.py --json serve.json --plot serve.png

See `python benchmarks/serve.py --help` for the columns and the method.
"""
import os
import sys

try:
    import tpcore.bench  # noqa: F401 (only whether tpcore is importable)
except ImportError:  # run from a source checkout that is not installed (the extension must be built)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

from tpcore.bench.__main__ import main

if __name__ == "__main__":
    sys.exit(main(["serve", *sys.argv[1:]]))
