"""A dataset of image files read from disk, with emulated storage latency: an input-bound job.

The images are generated locally on first use (nothing is downloaded): ``n`` small RGB images of
``size x size`` pixels in binary PPM files (``P6``, readable by any image viewer), one of ten
classes each (a noisy pattern per class), in a folder under the system's temporary directory
(``virtualflow-image-files-...``), written once and reused. Each ``__getitem__`` opens and
reads one file and then sleeps ``latency_s`` to emulate slow storage (a network file system, a
cold object store); sleeping, like real I/O, frees the CPU, so loader threads overlap it with
compute.

    virtualflow run examples/image_files.py --workers 2 --steps 30              # input-bound
    virtualflow run examples/image_files.py --workers 2 --steps 30 --loader-workers 4
    virtualflow status RUN_DIR        # where the step time went, reads per step, advice
    virtualflow plot RUN_DIR --breakdown
"""

from __future__ import annotations

import os
import tempfile
import time

import torch
from torch import nn
from torch.utils.data import Dataset

import virtualflow as vf

CLASSES = 10


def image_folder(n: int = 1024, size: int = 16, seed: int = 0, root: str | None = None) -> str:
    """The folder of ``n`` generated PPM images (created once; concurrent callers are safe: the
    files are written into a private folder that is renamed into place)."""
    root = root or tempfile.gettempdir()
    folder = os.path.join(root, f"virtualflow-image-files-{n}-{size}-{seed}")
    if os.path.isdir(folder):
        return folder
    tmp = tempfile.mkdtemp(prefix=".image-files-", dir=root)
    g = torch.Generator().manual_seed(seed)
    patterns = torch.rand(CLASSES, 3, size, size, generator=g)
    labels = torch.randint(0, CLASSES, (n,), generator=g)
    for i in range(n):
        img = (0.7 * patterns[labels[i]] + 0.3 * torch.rand(3, size, size, generator=g)) * 255
        pixels = img.to(torch.uint8).permute(1, 2, 0).contiguous().numpy().tobytes()
        with open(os.path.join(tmp, f"{i:06d}-{int(labels[i])}.ppm"), "wb") as f:
            f.write(f"P6\n{size} {size}\n255\n".encode() + pixels)
    try:
        os.rename(tmp, folder)
    except OSError:  # another process got there first: use its folder
        for name in os.listdir(tmp):
            os.remove(os.path.join(tmp, name))
        os.rmdir(tmp)
    return folder


def read_ppm(path: str) -> torch.Tensor:
    """A binary PPM file as a float tensor (3, height, width) in [0, 1]."""
    with open(path, "rb") as f:
        data = f.read()
    magic, dims, maxval, pixels = data.split(b"\n", 3)
    if magic != b"P6" or maxval != b"255":
        raise ValueError(f"{path} is not an 8-bit binary PPM (P6) image")
    w, h = (int(x) for x in dims.split())
    img = torch.frombuffer(bytearray(pixels), dtype=torch.uint8).view(h, w, 3)
    return img.permute(2, 0, 1).float() / 255.0


class ImageFiles(Dataset):
    """Image files in a folder, one per sample, label in the file name; ``latency_s`` of emulated
    storage latency per file read."""

    def __init__(self, folder: str, latency_s: float = 0.0) -> None:
        self.files = sorted(os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".ppm"))
        self.latency_s = latency_s

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        path = self.files[i]
        img = read_ppm(path)
        if self.latency_s > 0:
            time.sleep(self.latency_s)
        label = int(os.path.basename(path).split("-")[1].split(".")[0])
        return img, torch.tensor(label)


def make_model(size: int = 16) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * (size // 4) ** 2, CLASSES),
    )


def cross_entropy(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def make_job(latency_s: float = 0.002, n: int = 1024, size: int = 16, global_batch_size: int = 64,
             virtual_nodes: int = 8, root: str | None = None) -> vf.Job:
    """The job (``latency_s`` per file read; the other arguments shape the data and the batch)."""
    return vf.Job(
        name="image-files",
        model=lambda: make_model(size),
        optimizer=lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
        loss=cross_entropy,
        dataset=lambda: ImageFiles(image_folder(n, size, root=root), latency_s),
        global_batch_size=global_batch_size,
        virtual_nodes=virtual_nodes,
        seed=0,
    )


if __name__ == "__main__":
    result = vf.train(make_job, workers=2, steps=30, loader_workers=4, progress=True)
    print(f"final loss {result.history[-1]['loss']:.4f}")
