"""timm_odevit: continuous-depth and subquadratic Vision Transformers for timm.

Importing the package registers every model (``odevit_*``, ``ssog_vit_*``, ``looped_ssog_*``, ``ssog_ode_*``,
``dense_vit_*``, ``looped_vit_*``) in timm's registry.
"""
from .layers import CenterNorm, FieldBlock, MultiHeadAttention, OdeDepth, OdeSolverError, SeparableGaussianMixer
from .models import DepthVisionTransformer, create_depth_vit

__version__ = '0.1.0'
