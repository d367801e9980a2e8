"""Building blocks that know nothing of timm's model registry."""
from .block import FieldBlock
from .linalg import spectral_norm, spectral_norm_estimate
from .integrators import ADAPTIVE_METHODS, DISCRETISATION_OPTIONS, FIXED_GRID_METHODS, SOLVER_OPTIONS, DiscreteDepth, \
    LoopedDepth, OdeDepth, OdeSolverError, ode_trunk
from .mixers import MIXERS, IdentityMixer, MultiHeadAttention, SeparableGaussianMixer, create_mixer
from .norm import CenterNorm
