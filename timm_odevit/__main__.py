"""``python -m timm_odevit``: the main job (the pretrained demo, then the zoo tables) lives with the tools, in
``timm_odevit_tools/__main__.py``; this name is the one the README and users type."""
from timm_odevit_tools.__main__ import main

if __name__ == '__main__':
    raise SystemExit(main())
