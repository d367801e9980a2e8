"""Fashion-MNIST in the layout torchvision and timm read, the bundled test sample, and grey-to-model conversion.

Debian's ``dataset-fashion-mnist`` package (``apt-get install -y dataset-fashion-mnist``) puts the four IDX files,
gzipped, in ``/usr/share/datasets/fashion-mnist/``. torchvision's ``FashionMNIST`` (and so timm's
``--dataset torch/fashion_mnist``) reads them uncompressed from ``<root>/FashionMNIST/raw/``: ``layout_fashion_mnist``
puts them there. Images are 28x28 grey; ``GreyToChannels`` converts them to a model's channel count, and
``fashion_mnist_transform`` is timm's own eval transform for a model (so numbers match ``validate.py``).

The sample in ``tests/data/fashion_mnist_sample/`` holds 1,000 test images drawn with a fixed seed
(``make_sample``), in the same IDX format, for tests and the demo.
"""
import fcntl
import gzip
import hashlib
import logging
import os
import shutil
import struct
import tempfile
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, Iterator, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from torch import nn

from timm_odevit.models.pretrained import FASHION_MNIST_CLASSES, FASHION_MNIST_MEAN, FASHION_MNIST_STD

from ..files import write_failed

__all__ = [
    'DEBIAN_FASHION_MNIST', 'FASHION_MNIST_CLASSES', 'FASHION_MNIST_MEAN', 'FASHION_MNIST_STD',
    'FASHION_MNIST_TRAIN_IMAGES', 'IDX_FILES',
    'SAMPLE_DIR', 'GreyToChannels', 'fashion_mnist_dataset', 'fashion_mnist_transform', 'layout_fashion_mnist',
    'load_tensors', 'make_sample', 'find_source', 'split_size', 'cache_folder', 'prepare_fashion_mnist',
    'augment_batch', 'ImageSubset', 'build_dataset', 'DeviceBatches',
]

_logger = logging.getLogger(__name__)

PathLike = Union[str, os.PathLike]

DEBIAN_FASHION_MNIST = Path('/usr/share/datasets/fashion-mnist')
# the sample ships with the repository (tests and demo); a wheel install does not carry it
_CHECKOUT_SAMPLE = Path(__file__).resolve().parents[2] / 'tests' / 'data' / 'fashion_mnist_sample'
# a normal (non-editable) install has no checkout beside it: the wheel carries the sample inside the package
# (setup.py bundles it into the library's timm_odevit/<hub.demo's BUNDLE_DIR>/<SAMPLE_NAME>)
_BUNDLED_SAMPLE = Path(__file__).resolve().parents[2] / 'timm_odevit' / '_bundled' / 'fashion_mnist_sample'
SAMPLE_DIR = _CHECKOUT_SAMPLE if _CHECKOUT_SAMPLE.is_dir() else _BUNDLED_SAMPLE
# split -> (images, labels) file names as torchvision expects them under raw/
IDX_FILES = {
    'train': ('train-images-idx3-ubyte', 'train-labels-idx1-ubyte'),
    'test': ('t10k-images-idx3-ubyte', 't10k-labels-idx1-ubyte'),
}
FASHION_MNIST_TRAIN_IMAGES = 60000


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


def _idx_dims(path: Path) -> Tuple[int, ...]:
    """The dimensions an IDX file's header declares (the file may be gzipped)."""
    opener = gzip.open if path.suffix == '.gz' else open
    with opener(path, 'rb') as f:
        head = f.read(4)
        if len(head) < 4 or head[:3] != b'\x00\x00\x08':
            raise ValueError(f'{path} is not a uint8 IDX file: restore it (reinstall dataset-fashion-mnist, or copy '
                             'the IDX files again).')
        ndim = head[3]
        return struct.unpack(f'>{ndim}i', f.read(4 * ndim))


def _source_counts(src: Path) -> Dict[str, Optional[int]]:
    """split -> number of images ``src`` holds (None where ``src`` lacks that split)."""
    counts: Dict[str, Optional[int]] = {}
    for split, names in IDX_FILES.items():
        found = [_find_idx(src, n) for n in names]
        if any(f is None for f in found):
            counts[split] = None
            continue
        n_img, n_lbl = (_idx_dims(f)[0] for f in found)
        if n_img != n_lbl:
            raise ValueError(f'{src} is corrupt: {n_img} {split} images but {n_lbl} labels; restore its IDX files '
                             '(reinstall dataset-fashion-mnist, or copy them again).')
        counts[split] = n_img
    return counts


def _layout_ok(raw: Path, counts: Dict[str, Optional[int]]) -> bool:
    """Every file is there, its size is what its header declares, and it holds as many items as the source."""
    for split, names in IDX_FILES.items():
        for name in names:
            path = raw / name
            try:
                dims = _idx_dims(path)
            except (OSError, ValueError, struct.error):
                return False
            header = 4 + 4 * len(dims)
            if path.stat().st_size != header + int(np.prod(dims)) or dims[0] != (counts[split] or 0):
                return False
    return True


def layout_fashion_mnist(src: Optional[PathLike] = None, root: PathLike = 'data') -> Path:
    """Lay the IDX files in ``src`` out as ``<root>/FashionMNIST/raw/`` (uncompressed), which torchvision reads.

    Args:
        src: A folder with the four IDX files, gzipped or not (default: Debian's package, else the bundled sample).
        root: Target root; pass it as ``root=`` to torchvision or ``--data-dir`` to timm's train.py/validate.py.

    Returns:
        ``root`` as a Path. A layout already there is kept when every file has the size its header declares and as
        many items as the source; otherwise (an interrupted or poisoned copy) it is rebuilt. The layout is written
        to a temporary folder and renamed into place, so no reader ever sees half of it. A split missing from
        ``src`` (the sample has no training split) is written as an empty IDX file: torchvision checks all four exist.
    """
    src = Path(src) if src is not None else find_source()
    if not src.is_dir():
        raise FileNotFoundError(f'{src} does not exist: pass a folder of Fashion-MNIST IDX files, or install Debian\'s '
                                '`dataset-fashion-mnist` (apt-get install -y dataset-fashion-mnist, as root).')
    counts = _source_counts(src)
    if all(n is None for n in counts.values()):
        raise FileNotFoundError(
            f'{src} holds no Fashion-MNIST IDX files (expected e.g. {IDX_FILES["test"][0]}[.gz]). Install Debian\'s '
            '`dataset-fashion-mnist` or point src at a folder of the IDX files.')
    target = Path(root) / 'FashionMNIST'
    if _layout_ok(target / 'raw', counts):
        return Path(root)
    target.parent.mkdir(parents=True, exist_ok=True)
    # one builder at a time: processes started together (DDP ranks, parallel runs) would otherwise each move aside
    # the layout another one had just finished and was reading
    with open(target.parent / '.FashionMNIST.lock', 'w') as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not _layout_ok(target / 'raw', counts):
            _build_layout(src, target, counts)
    return Path(root)


def _build_layout(src: Path, target: Path, counts: Dict[str, Optional[int]]) -> None:
    """Write the layout to a temporary folder, check it, and rename it into place (a bad one is moved aside); a
    failed write (a full disk) leaves the cache as it was and says so."""
    tmp = Path(tempfile.mkdtemp(prefix='.FashionMNIST.', dir=target.parent))
    try:
        try:
            _write_layout(src, tmp / 'raw', counts)
        except OSError as e:
            raise write_failed(f'Laying out {src}', target.parent, e, 'Nothing there was changed: free space there '
                               'and run again, or lay out elsewhere (--root; XDG_CACHE_HOME for the default cache).'
                               ) from e
        if not _layout_ok(tmp / 'raw', counts):
            raise ValueError(f'{src} is corrupt: its IDX files are shorter than their headers declare.')
        if target.exists():
            # a bad layout is moved aside first (a rename, so a reader holding it open keeps its files)
            stale = Path(tempfile.mkdtemp(prefix='.FashionMNIST.stale.', dir=target.parent))
            os.replace(target, stale / 'FashionMNIST')
            shutil.rmtree(stale, ignore_errors=True)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _write_layout(src: Path, raw: Path, counts: Dict[str, Optional[int]]) -> None:
    """The four IDX files of ``src`` uncompressed into ``raw``; a split ``src`` lacks as an empty IDX file."""
    raw.mkdir()
    for split, names in IDX_FILES.items():
        if counts[split] is None:
            _logger.info('%s has no %s split; writing an empty one so torchvision opens the folder', src, split)
        for name, is_img in zip(names, (True, False)):
            if counts[split] is None:
                _write_empty_idx(raw / name, is_img)
                continue
            f = _find_idx(src, name)
            opener = gzip.open if f.suffix == '.gz' else open
            with opener(f, 'rb') as fin, open(raw / name, 'wb') as fout:
                shutil.copyfileobj(fin, fout)


def cache_folder(src: PathLike) -> Path:
    """The one cache folder for a laid-out source: ``$XDG_CACHE_HOME/timm_odevit/fashion_mnist/<name>-<hash>``
    (``~/.cache`` without XDG_CACHE_HOME); the hash of the source's path keeps two folders of one name apart."""
    src = Path(src).resolve()
    base = Path(os.environ.get('XDG_CACHE_HOME') or Path.home() / '.cache') / 'timm_odevit' / 'fashion_mnist'
    return base / f'{src.name}-{hashlib.sha256(str(src).encode()).hexdigest()[:8]}'


def prepare_fashion_mnist(src: Optional[PathLike] = None) -> Path:
    """``src`` (default: Debian's package, else the bundled sample) laid out in its cache folder; returns the root
    to pass to torchvision's FashionMNIST (checked, and rebuilt when bad, on every call)."""
    src = Path(src) if src is not None else find_source()
    return layout_fashion_mnist(src, cache_folder(src))


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
        raise ValueError(f'{root} has no {split} images (its {IDX_FILES[split][0]} is empty: the bundled sample holds '
                         'the test split only): give a folder with the training IDX files (--data-dir), or install '
                         'Debian\'s dataset-fashion-mnist (apt-get install -y dataset-fashion-mnist) and leave '
                         '--data-dir out.')
    return FashionMNIST(str(root), train=split == 'train', transform=transform, download=False)


def _laid_out_dataset(src: Optional[PathLike], split: str, cache: Optional[PathLike] = None,
                      transform: Optional[Callable] = None) -> Any:
    root = prepare_fashion_mnist(src) if cache is None else layout_fashion_mnist(src, cache)
    return fashion_mnist_dataset(root, split, transform=transform)


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
        cache_root: Where to lay the files out (default: ``cache_folder(src)``, the one cache).
        limit: Keep the first ``limit`` images only.
        indices: Keep these images only (in this order); overrides ``limit``.
        **data_args: Overrides for resolve_data_config (e.g. input_size, mean, std).
    """
    ds = _laid_out_dataset(src, split, cache_root, transform=fashion_mnist_transform(model, **data_args))
    if indices is None:
        indices = range(len(ds) if limit is None else min(limit, len(ds)))
    if len(indices) == 0:
        raise ValueError(f'{src or "The Fashion-MNIST source"} gives no {split} images for this request (limit '
                         f'{limit}, {0 if indices is None else len(indices)} indices): ask for at least one image.')
    xs, ys = zip(*(ds[int(i)] for i in indices))
    return torch.stack(xs), torch.tensor(ys)


AUGMENT_SHIFT = 2


def augment_batch(x: torch.Tensor, shift: int = AUGMENT_SHIFT, generator: Optional[torch.Generator] = None,
                  ) -> torch.Tensor:
    """Flip each image of a [B, C, H, W] batch left-right with probability 1/2, then shift it by up to ``shift``
    pixels each way (edge-padded), independently per image: the augmentation of the published SSoG weights."""
    b, _, h, w = x.shape
    dev = x.device
    flip = torch.rand(b, generator=generator, device=generator.device if generator else dev).to(dev) < 0.5
    x = torch.where(flip[:, None, None, None], x.flip(-1), x)
    # edge padding: the garment's background continues, where zeros would be a bright frame after normalisation
    padded = nn.functional.pad(x, (shift,) * 4, mode='replicate')
    dy, dx = torch.randint(0, 2 * shift + 1, (2, b), generator=generator,
                           device=generator.device if generator else dev).to(dev)
    rows = (dy[:, None] + torch.arange(h, device=dev))[:, :, None]
    cols = (dx[:, None] + torch.arange(w, device=dev))[:, None, :]
    return padded[torch.arange(b, device=dev)[:, None, None], :, rows, cols].permute(0, 3, 1, 2)


class ImageSubset(torch.utils.data.Dataset):
    """A dataset as PIL images of one ``mode`` ('RGB' or 'L'), optionally a fixed subset; ``transform`` is what
    timm's ``create_loader`` sets.

    Grey datasets (Fashion-MNIST) become 3 channels for 3-channel models (a teacher's input normalisation, 3 means,
    then applies unchanged); mode 'L' keeps them grey for 1-channel models.
    """

    def __init__(self, base: torch.utils.data.Dataset, indices: Optional[Sequence[int]] = None,
                 mode: str = 'RGB') -> None:
        if mode not in ('RGB', 'L'):
            raise ValueError(f"mode must be 'RGB' or 'L', got {mode!r}.")
        self.base = base
        self.mode = mode
        if hasattr(base, 'transform'):
            base.transform = None  # this wrapper applies the transform after the mode conversion
        self.indices = list(indices) if indices is not None else None
        self.transform: Optional[Callable] = None

    def __len__(self) -> int:
        return len(self.indices) if self.indices is not None else len(self.base)

    def __getitem__(self, index: int) -> Tuple[Any, int]:
        img, target = self.base[self.indices[index] if self.indices is not None else index]
        if hasattr(img, 'convert'):
            img = img.convert(self.mode)
        if self.transform is not None:
            img = self.transform(img)
        return img, int(target)


def build_dataset(
        name: str,
        root: Optional[PathLike],
        split: str,
        num_samples: Optional[int] = None,
        seed: int = 0,
        mode: str = 'RGB',
) -> ImageSubset:
    """A training or validation set for ``python -m timm_odevit_tools.train``.

    Args:
        name: 'fashion_mnist' (offline: ``root`` is a folder of the IDX files, default Debian's package, laid out in
            the one cache folder), or any timm ``create_dataset`` name ('' for an image folder, 'torch/cifar10', ...).
        root: Dataset folder (``--data-dir``).
        split: 'train', or 'test' / 'validation' / 'val' (Fashion-MNIST's test split); a folder name otherwise.
        num_samples: Keep a fixed random subset of this many (the same on every rank and run, drawn with ``seed``).
        mode: 'RGB' or 'L' (grey).
    """
    if num_samples is not None and num_samples < 1:
        raise ValueError(f'A subset needs at least one sample, got {num_samples}; leave the option out for all.')
    if root is not None and not Path(root).is_dir():
        raise FileNotFoundError(f'Data folder {root} does not exist.')
    if name == 'fashion_mnist':
        fm_split = 'train' if split in ('train', 'training') else 'test'
        base = fashion_mnist_dataset(prepare_fashion_mnist(root), fm_split)
    else:
        from timm.data import create_dataset
        base = create_dataset(name, root=root, split=split, download=False)
    if len(base) == 0:
        raise ValueError(f'The {split!r} split of {name or "the image folder"} at {root or "its default location"} '
                         'is empty: give --data-dir a folder that holds its images.')
    if num_samples is not None and num_samples > len(base):
        raise ValueError(f'A subset of {num_samples} samples asked for, but the {split!r} split of '
                         f'{name or "the image folder"} holds {len(base)}: ask for at most {len(base)}, or leave the '
                         'option out for all.')
    indices = None
    if num_samples is not None and num_samples < len(base):
        g = torch.Generator().manual_seed(seed)
        indices = torch.randperm(len(base), generator=g)[:num_samples].tolist()
    return ImageSubset(base, indices, mode)


class DeviceBatches:
    """A whole split decoded once by a loader and kept on the device, cut into batches there.

    A tiny 32 px model on a GPU can train faster than worker processes decode and collate images one by one; held on
    the device, a batch is one gather, and loading is ruled out as the limit (on the H200 it was not the limit: the
    same 1,000-3,000 images/s a run with eight runs sharing the GPU, benchmarks/gpu_h200/README.md). The images are
    what ``loader`` yields (its transform, without augmentation: ``augment_batch`` runs on each batch).
    ``shuffle``: each epoch is a permutation drawn from ``seed`` and the epoch alone (``set_epoch``), the same on
    every rank, each rank taking every ``world``-th image of it, as timm's distributed sampler does; the last partial
    batch is dropped, as timm's training loader does. Without ``shuffle``, every image once, in order (validation).
    """

    def __init__(self, loader: Iterable[Tuple[torch.Tensor, torch.Tensor]], device: Union[str, torch.device],
                 batch_size: int, shuffle: bool, seed: int = 0, rank: int = 0, world: int = 1) -> None:
        xs, ys = zip(*((x.to(device), y.to(device)) for x, y in loader))
        self.images, self.labels = torch.cat(xs), torch.cat(ys)
        self.batch_size, self.shuffle, self.seed, self.rank, self.world = batch_size, shuffle, seed, rank, world
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _order(self) -> torch.Tensor:
        n = len(self.labels)
        if not self.shuffle:
            return torch.arange(n, device=self.labels.device)
        g = torch.Generator().manual_seed(self.seed + 1000 * self.epoch)
        return torch.randperm(n, generator=g)[self.rank::self.world].to(self.labels.device)

    def __len__(self) -> int:
        n = len(self.labels)
        if self.shuffle:
            return (n // self.world) // self.batch_size
        return -(-n // self.batch_size)

    def __iter__(self) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
        order = self._order()
        for i in range(len(self)):
            idx = order[i * self.batch_size:(i + 1) * self.batch_size]
            yield self.images[idx], self.labels[idx]


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
