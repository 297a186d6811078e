"""python -m tpcore.bench SUBCOMMAND [options]; see tpcore.bench."""
from __future__ import annotations

import argparse
import importlib
import sys

from tpcore.bench import SUBCOMMANDS
from tpcore.bench import __doc__ as _DOC

DEFAULT = "collectives"


def main(argv: list[str] | None = None) -> int:
    """Run one benchmark subcommand (``python -m tpcore.bench``).

    Parameters
    ----------
    argv : list of str, optional
        The command line after the program name (default None: sys.argv[1:]).  Options
        without a subcommand go to the default one, "collectives".

    Returns
    -------
    int
        The exit status: the subcommand's, 2 without a subcommand, 130 on Ctrl-C.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    # Options without a subcommand go to the default one: `python -m tpcore.bench -n 4`.
    if argv and argv[0].startswith("-") and argv[0] not in ("-h", "--help"):
        argv.insert(0, DEFAULT)
    parser = argparse.ArgumentParser(prog="python -m tpcore.bench", description=_DOC,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", metavar="SUBCOMMAND")
    for name, modname in SUBCOMMANDS.items():
        mod = importlib.import_module(f"{__package__}.{modname}")
        p = sub.add_parser(name, help=(mod.__doc__ or "").strip().splitlines()[0], description=mod.__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        mod.add_arguments(p)
        p.set_defaults(run=getattr(mod, "cli", mod.run))  # cli(args) where run() is a library function
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    try:
        return args.run(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
