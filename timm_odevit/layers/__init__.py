"""Building blocks that know nothing of timm's model registry."""
from .block import FieldBlock
from .linalg import spectral_norm, spectral_norm_estimate
from .integrators import ADAPTIVE_METHODS, FIXED_GRID_METHODS, DiscreteDepth, LoopedDepth, OdeDepth, OdeSolverError
from .mixers import MIXERS, IdentityMixer, MultiHeadAttention, SeparableGaussianMixer, create_mixer
from .norm import CenterNorm
