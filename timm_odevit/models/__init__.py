"""Registered model families; importing this registers every entrypoint with timm."""
from .trunk import DepthVisionTransformer, checkpoint_filter_fn, create_depth_vit
from . import odevit, ssog
from .pretrained import mark_published_architectures, route_hf_hub_configs

route_hf_hub_configs()
mark_published_architectures()
