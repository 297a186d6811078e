"""``python -m tpcore.serve``: see `tpcore.serve.cli`."""
from tpcore.serve.cli import main

if __name__ == "__main__":
    main()
