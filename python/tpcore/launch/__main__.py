"""``python -m tpcore.launch``: see `tpcore.launch.launcher`."""
from tpcore.launch.launcher import main

if __name__ == "__main__":
    main()
