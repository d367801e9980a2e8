"""Pretrained weights: export to ``weights/``, verify against the manifest, push, and a local Hub mirror.

``python -m timm_odevit_tools.hub {export,verify,revisions,push,serve,evaluate,demo}``. The organisation name every
published ``hf_hub_id`` uses is ``ORG``, defined once in ``timm_odevit.models.pretrained``.
"""
from timm_odevit.models.pretrained import ORG, hub_id

WEIGHTS_FILE = 'model.safetensors'
CONFIG_FILE = 'config.json'
CARD_FILE = 'README.md'
MANIFEST_FILE = 'MANIFEST.json'
RECORD_FILE = 'record.json'

from .verify import RepoError, build_manifest, verify_repo, write_manifest  # noqa: E402

__all__ = ['ORG', 'WEIGHTS_FILE', 'CONFIG_FILE', 'CARD_FILE', 'MANIFEST_FILE', 'RECORD_FILE', 'hub_id', 'RepoError',
           'build_manifest', 'verify_repo', 'write_manifest']
