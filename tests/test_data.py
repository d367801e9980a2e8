"""Fashion-MNIST helper: layout for torchvision / timm, the bundled sample, grey-to-channels conversion."""
import gzip

import numpy as np
import pytest
import torch

import timm
import timm_odevit  # noqa: F401
from timm.data import create_dataset, create_transform, resolve_data_config

from timm_odevit_tools import data as fm


def test_sample_is_small_seeded_and_balanced(tmp_path):
    files = sorted(p.name for p in fm.SAMPLE_DIR.iterdir())
    assert files == ['t10k-images-idx3-ubyte.gz', 't10k-labels-idx1-ubyte.gz']
    assert sum(p.stat().st_size for p in fm.SAMPLE_DIR.iterdir()) < 600_000
    ds = fm.fashion_mnist_dataset(fm.layout_fashion_mnist(fm.SAMPLE_DIR, tmp_path), 'test')
    assert len(ds) == 1000 and tuple(ds.data.shape) == (1000, 28, 28)
    counts = np.bincount(ds.targets.numpy(), minlength=10)
    assert counts.min() >= 70, counts
    if (fm.DEBIAN_FASHION_MNIST / 't10k-images-idx3-ubyte.gz').is_file():
        # regenerating with the same seed from Debian's files gives the committed bytes
        fm.make_sample(fm.DEBIAN_FASHION_MNIST, tmp_path / 'again', n=1000, seed=0)
        for name in files:
            assert (tmp_path / 'again' / name).read_bytes() == (fm.SAMPLE_DIR / name).read_bytes()


def test_layout_reads_with_torchvision_and_timm(tmp_path):
    root = fm.layout_fashion_mnist(fm.SAMPLE_DIR, tmp_path / 'data')
    raw = root / 'FashionMNIST' / 'raw'
    assert sorted(p.name for p in raw.iterdir()) == sorted(n for pair in fm.IDX_FILES.values() for n in pair)
    # the sample has no training split: an empty one keeps torchvision's existence check happy
    with pytest.raises(ValueError, match='no train images'):
        fm.fashion_mnist_dataset(root, 'train')
    ds = create_dataset('torch/fashion_mnist', root=str(root), split='validation', download=False)
    img, label = ds[0]
    assert img.mode == 'L' and img.size == (28, 28) and 0 <= label < 10
    with gzip.open(fm.SAMPLE_DIR / 't10k-images-idx3-ubyte.gz') as f:
        first = np.frombuffer(f.read()[16:16 + 784], dtype=np.uint8).reshape(28, 28)
    assert np.array_equal(np.asarray(img), first)
    # laying out again keeps the files (no rewrite), and an unzipped source works too
    before = {p.name: p.stat().st_mtime_ns for p in raw.iterdir()}
    fm.layout_fashion_mnist(fm.SAMPLE_DIR, tmp_path / 'data')
    assert before == {p.name: p.stat().st_mtime_ns for p in raw.iterdir()}
    root2 = fm.layout_fashion_mnist(raw, tmp_path / 'again')
    assert len(fm.fashion_mnist_dataset(root2, 'test')) == 1000


def test_missing_source_says_what_to_do(tmp_path):
    with pytest.raises(FileNotFoundError, match='dataset-fashion-mnist'):
        fm.layout_fashion_mnist(tmp_path, tmp_path / 'out')
    with pytest.raises(ValueError, match="'train' or 'test'"):
        fm.fashion_mnist_dataset(tmp_path, 'val')


def test_grey_to_channels():
    g = torch.rand(2, 1, 4, 4)
    rgb = fm.GreyToChannels(3)(g)
    assert rgb.shape == (2, 3, 4, 4) and all(torch.equal(rgb[:, i:i + 1], g) for i in range(3))
    assert torch.allclose(fm.GreyToChannels(1)(rgb), g)
    assert fm.GreyToChannels(1)(g) is g
    with pytest.raises(ValueError, match='Cannot convert'):
        fm.GreyToChannels(4)(rgb)


def test_transform_matches_timm_for_grey_model_and_converts_for_rgb(tmp_path):
    ds = fm.fashion_mnist_dataset(fm.layout_fashion_mnist(fm.SAMPLE_DIR, tmp_path), 'test')
    img = ds[3][0]
    grey_model = timm.create_model('ssog_ode_tiny_patch4_32.fmnist', pretrained=False)
    ours = fm.fashion_mnist_transform(grey_model)(img)
    timms = create_transform(**resolve_data_config(model=grey_model))(img)
    assert ours.shape == (1, 32, 32) and torch.equal(ours, timms)
    rgb_model = timm.create_model('ssog_ode_tiny_patch4_32', pretrained=False)
    x = fm.fashion_mnist_transform(rgb_model)(img)
    assert x.shape == (3, 32, 32)
    cfg = resolve_data_config(model=rgb_model)
    unnorm = x * torch.tensor(cfg['std'])[:, None, None] + torch.tensor(cfg['mean'])[:, None, None]
    assert torch.allclose(unnorm[0], unnorm[1], atol=1e-6) and torch.allclose(unnorm[1], unnorm[2], atol=1e-6)
    with torch.no_grad():
        assert rgb_model.eval()(x[None]).shape == (1, 1000)


def test_load_tensors_indices_and_limit(tmp_path):
    model = timm.create_model('looped_ssog_tiny_patch4_32.fmnist', pretrained=False)
    x, y = fm.load_tensors(fm.SAMPLE_DIR, 'test', model=model, cache_root=tmp_path, limit=5)
    xi, yi = fm.load_tensors(fm.SAMPLE_DIR, 'test', model=model, cache_root=tmp_path, indices=[4, 0])
    assert x.shape == (5, 1, 32, 32) and torch.equal(xi[0], x[4]) and torch.equal(yi, y[[4, 0]])
    with pytest.raises(ValueError, match='no train images'):
        fm.load_tensors(fm.SAMPLE_DIR, 'train', model=model, cache_root=tmp_path)


def test_cache_is_one_folder_under_xdg_and_rebuilds_a_poisoned_entry(tmp_path, monkeypatch):
    monkeypatch.setenv('XDG_CACHE_HOME', str(tmp_path / 'xdg'))
    root = fm.prepare_fashion_mnist(fm.SAMPLE_DIR)
    assert root.parent == tmp_path / 'xdg' / 'timm_odevit' / 'fashion_mnist'
    raw = root / 'FashionMNIST' / 'raw'
    images = raw / fm.IDX_FILES['test'][0]
    good = images.read_bytes()
    # what an interrupted copy leaves: the file holds its 16-byte header only
    images.write_bytes(good[:16])
    assert fm.prepare_fashion_mnist(fm.SAMPLE_DIR) == root
    assert images.read_bytes() == good
    assert len(fm.fashion_mnist_dataset(root, 'test')) == 1000
    # a same-size file from another source (fewer images than the source) is rebuilt too
    labels = raw / fm.IDX_FILES['test'][1]
    labels.write_bytes(labels.read_bytes()[:8].replace(b'\x00\x00\x03\xe8', b'\x00\x00\x00\x00'))
    fm.prepare_fashion_mnist(fm.SAMPLE_DIR)
    assert len(fm.fashion_mnist_dataset(root, 'test')) == 1000
    # nothing but the entry is left in the cache (the temporary folders are gone)
    assert [p.name for p in root.parent.iterdir()] == [root.name]


def test_build_dataset_subsets_and_refuses_bad_input(tmp_path, monkeypatch):
    monkeypatch.setenv('XDG_CACHE_HOME', str(tmp_path / 'xdg'))
    ds = fm.build_dataset('fashion_mnist', fm.SAMPLE_DIR, 'validation', num_samples=10, seed=1, mode='L')
    again = fm.build_dataset('fashion_mnist', fm.SAMPLE_DIR, 'test', num_samples=10, seed=1, mode='L')
    assert len(ds) == 10 and ds.indices == again.indices and ds[0][0].mode == 'L'
    with pytest.raises(ValueError, match='at least one'):
        fm.build_dataset('fashion_mnist', fm.SAMPLE_DIR, 'test', num_samples=0)
    with pytest.raises(FileNotFoundError, match='does not exist'):
        fm.build_dataset('fashion_mnist', tmp_path / 'missing', 'test')


def _read_in_a_fresh_process(args):
    """One of several processes started together: prepare the cache, then read every image of it."""
    cache, src = args
    import os
    os.environ['XDG_CACHE_HOME'] = cache
    from timm_odevit_tools import data
    root = data.prepare_fashion_mnist(src)
    return len(data.fashion_mnist_dataset(root, 'test'))


@pytest.mark.slow
def test_cache_prepared_by_concurrent_processes(tmp_path):
    """Processes preparing the same cache at once (DDP ranks, parallel runs) all read a complete layout: a builder
    never moves aside a layout another process has just finished."""
    import multiprocessing
    src = str(fm.SAMPLE_DIR)
    with multiprocessing.get_context('spawn').Pool(6) as pool:
        sizes = pool.map(_read_in_a_fresh_process, [(str(tmp_path), src)] * 6)
    assert sizes == [1000] * 6


def test_layout_command_runs_clean(tmp_path):
    """``python -m timm_odevit_tools.data layout``, as the docs give it: the layout, and no warning that the module the
    models import ran twice (runpy's RuntimeWarning, when the command lived in the package's own module)."""
    import subprocess
    import sys
    proc = subprocess.run([sys.executable, '-W', 'error::RuntimeWarning', '-m', 'timm_odevit_tools.data', 'layout',
                           '--src', str(fm.SAMPLE_DIR), '--root', str(tmp_path)], capture_output=True, text=True)
    assert proc.returncode == 0 and 'RuntimeWarning' not in proc.stderr, proc.stderr[-2000:]
    assert 'FashionMNIST/raw ready' in proc.stdout
    assert sorted(p.name for p in (tmp_path / 'FashionMNIST' / 'raw').iterdir())[0].startswith('t10k-images')
