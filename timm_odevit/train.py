"""``python -m timm_odevit.train``, as the published model cards name it: the training command lives in
``timm_odevit_tools.train`` (docs/layout.md)."""
if __name__ == '__main__':
    from timm_odevit_tools.train.command import cli
    raise SystemExit(cli())
