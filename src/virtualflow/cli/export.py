"""``virtualflow export RUN_DIR --to model.safetensors`` (or ``--to model.pt``): the model of a
run's newest good state, consolidated into one file that plain PyTorch loads.

The state is found as a resume finds it (:func:`virtualflow.launching.resume.find_resume_state`:
``final.pt``, ``checkpoint.pt``, ``checkpoints/step-N.pt`` or a sharded ``checkpoints/step-N.dcp``
folder, the newest good one; damaged ones are reported and skipped). A sharded checkpoint's
chunks are reassembled whatever the number of workers that wrote them. ``.safetensors`` needs the
``safetensors`` package (``pip install virtualflow[export]``); ``.pt`` is a plain ``state_dict``
(``torch.load(path, weights_only=True)``).
"""

from __future__ import annotations

import argparse
import os

import torch

from virtualflow.launching.resume import find_resume_state
from virtualflow.records.rundir import atomic_write
from virtualflow.runtime.checkpoint import load_state
from virtualflow.runtime.dcp import is_dcp, load_dcp_model

FORMATS = (".safetensors", ".pt")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="write a run's model as one .safetensors or .pt file",
                       description="Consolidate the model of a run's newest good checkpoint (a single-file or a "
                                   "sharded one) into one file: .safetensors, or .pt (a plain state_dict).")
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory, a state file or a step-N.dcp folder")
    p.add_argument("--to", required=True, metavar="FILE", help="model.safetensors or model.pt")
    p.set_defaults(func=main)


def export_model(source: str, to: str) -> tuple[str, int, int]:
    """Write the model of ``source``'s newest good state to ``to``; returns (the state read, its
    step, the number of tensors)."""
    ext = os.path.splitext(to)[1]
    if ext not in FORMATS:
        raise ValueError(f"--to {to!r}: the file must end in .safetensors or .pt (a plain state_dict)")
    if ext == ".safetensors":
        try:
            from safetensors.torch import save as st_save
        except ImportError:
            raise ValueError("--to *.safetensors needs the safetensors package: pip install virtualflow[export], or "
                             "export to a .pt file") from None
    path, step = find_resume_state(source, None)
    model = load_dcp_model(path) if is_dcp(path) else load_state(path)["model"]
    model = {k: v.detach().cpu().contiguous() for k, v in model.items()}
    if ext == ".safetensors":
        data = st_save(model, metadata={"source": os.path.abspath(path), "step": str(step)})
        atomic_write(to, data)
    else:
        atomic_write(to, lambda f: torch.save(model, f))
    return path, step, len(model)


def main(args: argparse.Namespace) -> int:
    path, step, n = export_model(args.run_dir, args.to)
    print(f"wrote {args.to}: {n} tensors of the model at step {step}, from {path}")
    return 0
