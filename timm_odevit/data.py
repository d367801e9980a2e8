"""Fashion-MNIST in the layout torchvision and timm read, the bundled test sample, and grey-to-model conversion.

Debian's ``dataset-fashion-mnist`` package (``apt-get install -y dataset-fashion-mnist``) puts the four IDX files,
gzipped, in ``/usr/share/datasets/fashion-mnist/``. torchvision's ``FashionMNIST`` (and so timm's
``--dataset torch/fashion_mnist``) reads them uncompressed from ``<root>/FashionMNIST/raw/``: ``layout_fashion_mnist``
puts them there. Images are 28x28 grey; ``GreyToChannels`` converts them to a model's channel count, and
``fashion_mnist_transform`` is timm's own eval transform for a model (so numbers match ``validate.py``).

The sample in ``tests/data/fashion_mnist_sample/`` holds 1,000 test images drawn with a fixed seed
(``make_sample``), in the same IDX format, for tests and the demo.
"""
import gzip
import logging
import os
import shutil
import struct
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from torch import nn

__all__ = [
    'DEBIAN_FASHION_MNIST', 'FASHION_MNIST_CLASSES', 'FASHION_MNIST_MEAN', 'FASHION_MNIST_STD', 'IDX_FILES',
    'SAMPLE_DIR', 'GreyToChannels', 'fashion_mnist_dataset', 'fashion_mnist_transform', 'layout_fashion_mnist',
    'load_tensors', 'make_sample', 'find_source', 'split_size',
]

_logger = logging.getLogger(__name__)

PathLike = Union[str, os.PathLike]

DEBIAN_FASHION_MNIST = Path('/usr/share/datasets/fashion-mnist')
# the sample ships with the repository (tests and demo); a wheel install does not carry it
SAMPLE_DIR = Path(__file__).resolve().parent.parent / 'tests' / 'data' / 'fashion_mnist_sample'
# split -> (images, labels) file names as torchvision expects them under raw/
IDX_FILES = {
    'train': ('train-images-idx3-ubyte', 'train-labels-idx1-ubyte'),
    'test': ('t10k-images-idx3-ubyte', 't10k-labels-idx1-ubyte'),
}
FASHION_MNIST_CLASSES = (
    'T-shirt/top', 'Trouser', 'Pullover', 'Dress', 'Coat', 'Sandal', 'Shirt', 'Sneaker', 'Bag', 'Ankle boot')
# mean / std of the 60k training images scaled to [0, 1] (computed by load_tensors(..., normalize=False))
FASHION_MNIST_MEAN = (0.2860,)
FASHION_MNIST_STD = (0.3530,)


def _find_idx(src: Path, name: str) -> Optional[Path]:
    for cand in (src / name, src / f'{name}.gz', src / 'FashionMNIST' / 'raw' / name,
                 src / 'FashionMNIST' / 'raw' / f'{name}.gz'):
        if cand.is_file():
            return cand
    return None


def find_source() -> Path:
    """The full dataset if Debian's package is installed, else the bundled sample (test split only)."""
    if _find_idx(DEBIAN_FASHION_MNIST, IDX_FILES['test'][0]) is not None:
        return DEBIAN_FASHION_MNIST
    if _find_idx(SAMPLE_DIR, IDX_FILES['test'][0]) is not None:
        return SAMPLE_DIR
    raise FileNotFoundError(
        f'No Fashion-MNIST found: install it with `apt-get install -y dataset-fashion-mnist` (as root; files land in '
        f'{DEBIAN_FASHION_MNIST}), or pass a folder holding the IDX files.')


def _write_empty_idx(path: Path, images: bool) -> None:
    # IDX header: two zero bytes, dtype 0x08 (uint8), ndim; then big-endian int32 dims
    dims = (0, 28, 28) if images else (0,)
    path.write_bytes(struct.pack('>HBB', 0, 8, len(dims)) + struct.pack(f'>{len(dims)}i', *dims))


def layout_fashion_mnist(src: Optional[PathLike] = None, root: PathLike = 'data') -> Path:
    """Lay the IDX files in ``src`` out as ``<root>/FashionMNIST/raw/`` (uncompressed), which torchvision reads.

    Args:
        src: A folder with the four IDX files, gzipped or not (default: Debian's package, else the bundled sample).
        root: Target root; pass it as ``root=`` to torchvision or ``--data-dir`` to timm's train.py/validate.py.

    Returns:
        ``root`` as a Path. Files already in place with the right size are kept. A split missing from ``src`` (the
        sample has no training split) is written as an empty IDX file, because torchvision checks all four exist.
    """
    src = Path(src) if src is not None else find_source()
    raw = Path(root) / 'FashionMNIST' / 'raw'
    raw.mkdir(parents=True, exist_ok=True)
    found_any = False
    for split, names in IDX_FILES.items():
        found = [_find_idx(src, n) for n in names]
        if any(f is None for f in found):
            _logger.info('%s has no %s split; writing an empty one so torchvision opens the folder', src, split)
            for n, is_img in zip(names, (True, False)):
                if not (raw / n).is_file():
                    _write_empty_idx(raw / n, is_img)
            continue
        found_any = True
        for f, n in zip(found, names):
            dst = raw / n
            # an existing file is complete: it only ever appears through the atomic rename below
            if dst.is_file():
                continue
            opener = gzip.open if f.suffix == '.gz' else open
            tmp = dst.with_name(f'{dst.name}.{os.getpid()}.tmp')
            # decompress to a temporary name then rename: an interrupted copy never looks complete
            with opener(f, 'rb') as fin, open(tmp, 'wb') as fout:
                shutil.copyfileobj(fin, fout)
            os.replace(tmp, dst)
    if not found_any:
        raise FileNotFoundError(
            f'{src} holds no Fashion-MNIST IDX files (expected e.g. {IDX_FILES["test"][0]}[.gz]). Install Debian\'s '
            '`dataset-fashion-mnist` or point src at a folder of the IDX files.')
    return Path(root)


class GreyToChannels(nn.Module):
    """Convert a [C, H, W] or [B, C, H, W] image tensor to ``in_chans`` channels (grey repeats, RGB averages)."""

    def __init__(self, in_chans: int) -> None:
        super().__init__()
        self.in_chans = in_chans

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = x.shape[-3]
        if c == self.in_chans:
            return x
        if c == 1:
            return x.expand(*x.shape[:-3], self.in_chans, *x.shape[-2:]).contiguous()
        if self.in_chans == 1:
            return x.mean(dim=-3, keepdim=True)
        raise ValueError(f'Cannot convert {c}-channel images to {self.in_chans} channels.')


def fashion_mnist_transform(model: Optional[nn.Module] = None, **data_args: Any) -> Callable:
    """timm's eval transform for ``model`` (resolve_data_config + create_transform), then grey-to-channels.

    A model built for 1 channel with Fashion-MNIST statistics (our pretrained weights) sees exactly what
    timm's validate.py gives it with ``--in-chans 1``; a 3-channel model gets the grey image repeated.
    """
    from timm.data import create_transform, resolve_data_config
    from torchvision import transforms
    cfg = resolve_data_config(data_args, model=model)
    in_chans = cfg['input_size'][0]
    # resize/crop/to-tensor on the 1-channel image with identity normalisation, convert channels, then normalise
    # with the model's per-channel statistics (for a 1-channel model this is exactly validate.py's transform)
    grey = create_transform(**dict(cfg, input_size=(1, *cfg['input_size'][1:]), mean=(0.,), std=(1.,)))
    return transforms.Compose([grey, GreyToChannels(in_chans), transforms.Normalize(cfg['mean'], cfg['std'])])


def fashion_mnist_dataset(
        root: PathLike,
        split: str = 'test',
        transform: Optional[Callable] = None,
) -> torch.utils.data.Dataset:
    """torchvision's FashionMNIST over a folder laid out by ``layout_fashion_mnist`` (never downloads)."""
    from torchvision.datasets import FashionMNIST
    if split not in ('train', 'test'):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    images = Path(root) / 'FashionMNIST' / 'raw' / IDX_FILES[split][0]
    if images.is_file() and images.stat().st_size <= 16:
        # a placeholder written by layout_fashion_mnist: torchvision cannot parse an empty IDX file
        raise ValueError(f'{root} has no {split} images (the bundled sample holds the test split only); lay out the '
                         f'full dataset (`apt-get install -y dataset-fashion-mnist`) for training.')
    return FashionMNIST(str(root), train=split == 'train', transform=transform, download=False)


def _laid_out_dataset(src: Optional[PathLike], split: str, cache_root: Optional[PathLike] = None,
                      transform: Optional[Callable] = None) -> Any:
    src = Path(src) if src is not None else find_source()
    if cache_root is None:
        cache_root = Path(os.environ.get('XDG_CACHE_HOME', Path.home() / '.cache')) / 'timm_odevit' / 'fashion_mnist'
        cache_root = cache_root / src.resolve().name
    return fashion_mnist_dataset(layout_fashion_mnist(src, cache_root), split, transform=transform)


def split_size(src: Optional[PathLike] = None, split: str = 'train') -> int:
    """How many images a split of ``src`` (default: Debian's package, else the sample) holds."""
    return len(_laid_out_dataset(src, split))


def load_tensors(
        src: Optional[PathLike] = None,
        split: str = 'test',
        model: Optional[nn.Module] = None,
        cache_root: Optional[PathLike] = None,
        limit: Optional[int] = None,
        indices: Optional[Sequence[int]] = None,
        **data_args: Any,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Images (preprocessed for ``model`` with timm's eval transform) and labels of one split, as two tensors.

    Args:
        src: IDX folder (default: Debian's package, else the sample). Laid out under ``cache_root`` first.
        split: 'train' or 'test'.
        model: The model whose pretrained cfg decides size, channels, mean and std.
        cache_root: Where to lay the files out (default: ``~/.cache/timm_odevit/fashion_mnist/<name of src>``).
        limit: Keep the first ``limit`` images only.
        indices: Keep these images only (in this order); overrides ``limit``.
        **data_args: Overrides for resolve_data_config (e.g. input_size, mean, std).
    """
    ds = _laid_out_dataset(src, split, cache_root, transform=fashion_mnist_transform(model, **data_args))
    if indices is None:
        indices = range(len(ds) if limit is None else min(limit, len(ds)))
    if len(indices) == 0:
        raise ValueError(f'{src} has no {split} images.')
    xs, ys = zip(*(ds[int(i)] for i in indices))
    return torch.stack(xs), torch.tensor(ys)


def _write_idx(path: Path, arr: np.ndarray) -> None:
    header = struct.pack('>HBB', 0, 8, arr.ndim) + struct.pack(f'>{arr.ndim}i', *arr.shape)
    # mtime=0 keeps the gzip bytes (and so the committed file) identical across runs
    with open(path, 'wb') as raw, gzip.GzipFile(fileobj=raw, mode='wb', compresslevel=9, mtime=0) as f:
        f.write(header + arr.astype(np.uint8).tobytes())


def make_sample(
        src: PathLike = DEBIAN_FASHION_MNIST,
        dst: PathLike = SAMPLE_DIR,
        n: int = 1000,
        seed: int = 0,
) -> Dict[str, Any]:
    """Write ``n`` test images drawn without replacement with ``seed`` (indices sorted) as IDX.gz files.

    Returns the indices chosen and the class counts.
    """
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        ds = fashion_mnist_dataset(layout_fashion_mnist(src, tmp), 'test')
        idx = np.sort(np.random.default_rng(seed).choice(len(ds), size=n, replace=False))
        images = ds.data.numpy()[idx]
        labels = ds.targets.numpy()[idx]
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    _write_idx(dst / f'{IDX_FILES["test"][0]}.gz', images)
    _write_idx(dst / f'{IDX_FILES["test"][1]}.gz', labels)
    return {'indices': idx.tolist(), 'class_counts': np.bincount(labels, minlength=10).tolist(), 'seed': seed}


def _main(argv: Optional[Sequence[str]] = None) -> None:
    import argparse
    p = argparse.ArgumentParser(prog='python -m timm_odevit.data', description=__doc__.split('\n')[0])
    sub = p.add_subparsers(dest='cmd', required=True)
    lay = sub.add_parser('layout', help='lay IDX files out as <root>/FashionMNIST/raw/')
    lay.add_argument('--src', default=None, help='folder of IDX files (default: Debian package, else the sample)')
    lay.add_argument('--root', default='data')
    smp = sub.add_parser('sample', help='write the seeded test sample')
    smp.add_argument('--src', default=str(DEBIAN_FASHION_MNIST))
    smp.add_argument('--dst', default=str(SAMPLE_DIR))
    smp.add_argument('-n', type=int, default=1000)
    smp.add_argument('--seed', type=int, default=0)
    args = p.parse_args(argv)
    if args.cmd == 'layout':
        root = layout_fashion_mnist(args.src, args.root)
        print(f'{root}/FashionMNIST/raw ready: torchvision FashionMNIST(root={str(root)!r}) or timm '
              f'--dataset torch/fashion_mnist --data-dir {root}')
    else:
        info = make_sample(args.src, args.dst, args.n, args.seed)
        print(f'wrote {args.n} test images (seed {args.seed}) to {args.dst}; classes {info["class_counts"]}')


if __name__ == '__main__':
    _main()
