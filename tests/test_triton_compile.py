"""The Triton mixer compiles for real GPUs without one: every configuration the dispatcher can launch (dtypes, both
kernel orientations, the grids of 224, 512 and 1024 px at every width; head dim 64 at tiny, small and base) is
compiled ahead of time for sm_80 and sm_90 with Triton's own ptxas, and a register spill fails like a compile error.
``python tests/test_triton_compile.py`` prints the table docs/benchmark.md records."""
import math
import os
import re
import subprocess
import sys
import tempfile
from typing import Dict, List, Tuple

import pytest
import torch

from timm_odevit.layers.fused_mixer import (HAS_TRITON, TRITON_MAX_WIDTH, _separable_mix_kernel, negligible_weight,
                                            triton_launch_config)

# (image px, patch grid width) at patch 16; 2048 px (128 wide) is above TRITON_MAX_WIDTH: never launched
GRIDS = ((224, 14), (512, 32), (1024, 64))
HEAD_DIM = 64  # tiny, small and base alike (192/3, 384/6, 768/12)
DTYPES = {'float32': 'fp32', 'bfloat16': 'bf16', 'float16': 'fp16'}
ARCHS = (80, 90)


def _ptxas() -> str:
    import triton
    return os.path.join(os.path.dirname(triton.__file__), 'backends', 'nvidia', 'bin', 'ptxas')


def compile_config(width: int, dtype: str, transpose: bool, arch: int) -> Dict[str, int]:
    """Registers, spill bytes (stores + loads), shared memory and the PTX's tensor-core (``mma``/``wgmma``) and
    float32 ``fma`` instructions (static counts) of one configuration, compiled for ``sm_<arch>``."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    config = triton_launch_config(width, HEAD_DIM, getattr(torch, dtype), transpose)
    ptr = f'*{DTYPES[dtype]}'
    signature = {'v_ptr': ptr, 'band_y_ptr': '*fp32', 'rows_y_ptr': '*fp32', 'band_x_ptr': '*fp32',
                 'rows_x_ptr': '*fp32', 'y_ptr': ptr, **{k: 'i32' for k in 'N C H W P K D heads'.split()}}
    constexprs = dict(MEAN_PREFIX=True, TRANSPOSE=transpose, LOG_NEGLIGIBLE=math.log(negligible_weight(torch.float32)),
                      IEEE=dtype == 'float32', UPCAST=False, BI=config['BI'], BW=config['BW'], BD=config['BD'])
    signature.update({k: 'constexpr' for k in constexprs})
    # as a launch specializes them: the pointers, C and D (head dim 64), a grid side of 32 or 64 divisible by 16
    aligned = [k for k in signature if k.endswith('_ptr')] + ['C', 'D'] + ['H', 'W'] * (width % 16 == 0)
    attrs = {(_separable_mix_kernel.arg_names.index(k),): [['tt.divisibility', 16]] for k in aligned}
    kernel = triton.compile(ASTSource(fn=_separable_mix_kernel, signature=signature, constexprs=constexprs,
                                      attrs=attrs),
                            target=GPUTarget('cuda', arch, 32), options={'num_warps': config['num_warps']})
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, 'kernel.ptx')
        with open(ptx, 'w') as f:
            f.write(kernel.asm['ptx'])
        gpu = f'sm_{arch}a' if arch >= 90 else f'sm_{arch}'
        r = subprocess.run([_ptxas(), '-v', f'--gpu-name={gpu}', ptx, '-o', os.path.join(tmp, 'kernel.cubin')],
                           capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    spills = re.search(r'(\d+) bytes spill stores, (\d+) bytes spill loads', r.stderr)
    return {'registers': int(re.search(r'Used (\d+) registers', r.stderr).group(1)),
            'spill_bytes': int(spills.group(1)) + int(spills.group(2)),
            'shared_bytes': int(kernel.metadata.shared), 'warps': config['num_warps'],
            'mma': len(re.findall(r'^\s*(?:wgmma\.mma_async|mma)\.', kernel.asm['ptx'], re.M)),
            'fma': len(re.findall(r'^\s*fma\.rn\.f32', kernel.asm['ptx'], re.M))}


def configurations() -> List[Tuple[int, int, str, bool, int]]:
    return [(px, w, d, t, a) for px, w in GRIDS for d in DTYPES for t in (False, True) for a in ARCHS]


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TRITON, reason='Triton is not installed: nothing to compile')
def test_every_launchable_configuration_compiles_for_sm80_and_sm90_without_spills():
    assert max(w for _, w in GRIDS) == TRITON_MAX_WIDTH  # the widest grid the dispatcher launches is compiled
    if not os.path.isfile(_ptxas()):
        pytest.skip(f"Triton's ptxas is missing ({_ptxas()})")
    spilled = {}
    for px, width, dtype, transpose, arch in configurations():
        info = compile_config(width, dtype, transpose, arch)
        if info['spill_bytes']:
            spilled[(px, dtype, transpose, arch)] = info
    assert spilled == {}


def test_the_dispatcher_refuses_grids_wider_than_the_compiled_ones():
    from timm_odevit.layers.fused_mixer import separable_mix_triton
    if not HAS_TRITON:
        pytest.skip('Triton is not installed')
    v = torch.zeros(1, 2 * (TRITON_MAX_WIDTH + 1), 6)
    factors = (torch.zeros(3, 1, 3), torch.zeros(3, 1, 2), torch.zeros(3, 1, 2 * TRITON_MAX_WIDTH + 1),
               torch.zeros(3, 1, TRITON_MAX_WIDTH + 1))
    with pytest.raises(ValueError, match='grids up to 64 patches wide.*ssog_mixing="fused"'):
        separable_mix_triton(v, *factors, 2, TRITON_MAX_WIDTH + 1, False)


if __name__ == '__main__':
    print('| px | dtype | transposed | arch | warps | registers | spill bytes | shared bytes | mma | fma |\n'
          '|---:|---|---|---:|---:|---:|---:|---:|---:|---:|')
    for px, width, dtype, transpose, arch in configurations():
        i = compile_config(width, dtype, transpose, arch)
        print(f"| {px} | {dtype} | {'yes' if transpose else 'no'} | sm_{arch} | {i['warps']} | {i['registers']} | "
              f"{i['spill_bytes']} | {i['shared_bytes']} | {i['mma']} | {i['fma']} |", flush=True)
    sys.exit(0)
