"""``python -m timm_odevit_tools.train --help``."""
from .command import main

if __name__ == '__main__':
    main()
