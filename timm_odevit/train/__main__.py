"""``python -m timm_odevit.train --help``."""
from .command import main

if __name__ == '__main__':
    main()
