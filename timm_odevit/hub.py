"""``python -m timm_odevit.hub``, as earlier revisions of the published cards name it: the Hub tools live in
``timm_odevit_tools.hub`` (docs/layout.md)."""
if __name__ == '__main__':
    from timm_odevit_tools.hub.__main__ import cli
    raise SystemExit(cli())
