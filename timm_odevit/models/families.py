"""The one family table: every model family, its token mixer, its depth setting and its dense-attention twin.

The zoo table, the benchmark, the study and the recipes all read this table instead of declaring their own.
"""
from dataclasses import dataclass
from typing import Dict, NamedTuple, Optional, Tuple

__all__ = ['Family', 'FAMILIES', 'MixerPair', 'SETTINGS', 'SIZES', 'family_of', 'model_name']


@dataclass(frozen=True)
class Family:
    name: str
    mixer: str  # 'ssog' or 'attention'
    depth: str  # 'discrete', 'looped' or 'ode'
    twin: Optional[str] = None  # the dense-attention twin of an SSoG family
    steer: bool = False  # content-steered Gaussians (``ssog_steer=True``): a variant of the SSoG family of its depth

    @property
    def is_ssog(self) -> bool:
        return self.mixer == 'ssog'


FAMILIES: Dict[str, Family] = {f.name: f for f in (
    Family('ssog_vit', 'ssog', 'discrete', twin='dense_vit'),
    # steered in the discrete setting only: the ODE families keep fixed kernels, whose Lipschitz bound makes their
    # ODE well-posed (any SSoG model still takes ssog_steer=True)
    Family('ssog_vit_steer', 'ssog', 'discrete', twin='dense_vit', steer=True),
    Family('looped_ssog', 'ssog', 'looped', twin='looped_vit'),
    Family('ssog_ode', 'ssog', 'ode', twin='odevit'),
    Family('dense_vit', 'attention', 'discrete'),
    Family('looped_vit', 'attention', 'looped'),
    Family('odevit', 'attention', 'ode'),
)}


class MixerPair(NamedTuple):
    """An SSoG family and its dense-attention twin (same trunk, other mixer)."""
    ssog: str
    dense: str


# depth setting -> its pair of families: the paper's fixed-kernel SSoG and its dense twin
SETTINGS: Dict[str, MixerPair] = {f.depth: MixerPair(f.name, f.twin) for f in FAMILIES.values()
                                  if f.is_ssog and not f.steer}
SIZES: Tuple[str, ...] = ('tiny', 'small', 'base')


def model_name(family: str, size: str, small_image: bool = False) -> str:
    """Registered name of a family at a size: ``ssog_ode_small``, or ``ssog_ode_tiny_patch4_32`` for small images."""
    if family not in FAMILIES:
        raise ValueError(f'Unknown family {family!r}; choose one of {list(FAMILIES)}.')
    if size not in SIZES:
        raise ValueError(f'Unknown size {size!r}; choose one of {list(SIZES)}.')
    return f'{family}_{size}' + ('_patch4_32' if small_image else '')


def family_of(arch: str) -> Family:
    """The family of a registered name: ``ssog_vit_steer_tiny_patch4_32`` -> ``ssog_vit_steer`` (ValueError if none)."""
    # the longest family name that prefixes the arch: ssog_vit_steer_* before ssog_vit_*
    for name in sorted(FAMILIES, key=len, reverse=True):
        if arch.startswith(name + '_'):
            return FAMILIES[name]
    raise ValueError(f'{arch!r} names no family of this package; families: {list(FAMILIES)}.')
