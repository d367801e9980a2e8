"""Datasets for ``python -m timm_odevit.distill``: Fashion-MNIST from the Debian package (offline), any dataset
timm's ``create_dataset`` knows (image folders included), as RGB or grey images and optionally a fixed subset."""
import gzip
import os
import shutil
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch
from torch.utils.data import Dataset
from timm.data import create_dataset

__all__ = ['FASHION_MNIST_SOURCES', 'prepare_fashion_mnist', 'ImageSubset', 'build_dataset']

# where Debian's dataset-fashion-mnist package puts the IDX files (gzipped)
FASHION_MNIST_SOURCES = ('/usr/share/datasets/fashion-mnist',)
FASHION_MNIST_FILES = ('train-images-idx3-ubyte', 'train-labels-idx1-ubyte', 't10k-images-idx3-ubyte',
                       't10k-labels-idx1-ubyte')


def prepare_fashion_mnist(cache_dir: str, sources: Sequence[str] = FASHION_MNIST_SOURCES) -> str:
    """Lay the IDX files out where torchvision's FashionMNIST reads them (``<root>/FashionMNIST/raw``); returns root.

    Raises FileNotFoundError saying how to install the data when no source has it.
    """
    raw = os.path.join(cache_dir, 'FashionMNIST', 'raw')
    if all(os.path.isfile(os.path.join(raw, f)) for f in FASHION_MNIST_FILES):
        return cache_dir
    for src in sources:
        if all(os.path.isfile(os.path.join(src, f + '.gz')) or os.path.isfile(os.path.join(src, f))
               for f in FASHION_MNIST_FILES):
            os.makedirs(raw, exist_ok=True)
            for f in FASHION_MNIST_FILES:
                dst = os.path.join(raw, f)
                tmp = dst + f'.tmp{os.getpid()}'
                if os.path.isfile(os.path.join(src, f)):
                    shutil.copyfile(os.path.join(src, f), tmp)
                else:
                    with gzip.open(os.path.join(src, f + '.gz'), 'rb') as fi, open(tmp, 'wb') as fo:
                        shutil.copyfileobj(fi, fo)
                os.replace(tmp, dst)  # atomic: two ranks preparing at once never see half a file
            return cache_dir
    raise FileNotFoundError(
        f'Fashion-MNIST not found in {list(sources)}. Install it offline with `apt-get update && apt-get install -y '
        'dataset-fashion-mnist` (as root), or pass --dataset and --data-dir for another dataset.')


class ImageSubset(Dataset):
    """A dataset as PIL images of one ``mode`` ('RGB' or 'L'), optionally a fixed subset; ``transform`` is what
    timm's ``create_loader`` sets.

    By default grey datasets (Fashion-MNIST) become 3 channels so a teacher's input normalisation (3 means) applies
    unchanged; mode 'L' keeps them grey for 1-channel models.
    """

    def __init__(self, base: Dataset, indices: Optional[List[int]] = None, mode: str = 'RGB') -> None:
        if mode not in ('RGB', 'L'):
            raise ValueError(f"mode must be 'RGB' or 'L', got {mode!r}.")
        self.base = base
        self.mode = mode
        if hasattr(base, 'transform'):
            base.transform = None  # this wrapper applies the transform after the mode conversion
        self.indices = indices
        self.transform: Optional[Callable] = None

    def __len__(self) -> int:
        return len(self.indices) if self.indices is not None else len(self.base)

    def __getitem__(self, index: int) -> Tuple[Any, Any]:
        img, target = self.base[self.indices[index] if self.indices is not None else index]
        if hasattr(img, 'convert'):
            img = img.convert(self.mode)
        if self.transform is not None:
            img = self.transform(img)
        return img, int(target)


def build_dataset(
        name: str,
        root: Optional[str],
        split: str,
        num_samples: Optional[int] = None,
        seed: int = 0,
        cache_dir: Optional[str] = None,
        mode: str = 'RGB',
) -> ImageSubset:
    """``name`` 'fashion_mnist' (built in, offline), or any timm ``create_dataset`` name ('' for an image folder
    with train/validation sub-folders, 'torch/cifar10', ...). ``num_samples`` keeps a fixed random subset;
    ``mode`` 'RGB' or 'L' (grey)."""
    if name == 'fashion_mnist':
        # --data-dir may name the Debian folder itself (read only): the torchvision layout goes to the cache
        cache = cache_dir or os.path.join(os.path.expanduser('~'), '.cache', 'timm_odevit')
        sources = ((root,) if root else ()) + FASHION_MNIST_SOURCES
        base = create_dataset('torch/fashion_mnist', root=prepare_fashion_mnist(cache, sources), split=split,
                              download=False)
    else:
        base = create_dataset(name, root=root, split=split, download=False)
    indices = None
    if num_samples is not None and num_samples < len(base):
        # the same subset on every rank and every run
        g = torch.Generator().manual_seed(seed)
        indices = torch.randperm(len(base), generator=g)[:num_samples].tolist()
    return ImageSubset(base, indices, mode)
