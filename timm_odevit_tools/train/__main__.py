"""``python -m timm_odevit_tools.train --help``."""
from .command import cli

if __name__ == '__main__':
    raise SystemExit(cli())
