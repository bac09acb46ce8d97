"""``virtualflow export RUN_DIR --to model.safetensors`` (or ``--to model.pt``): the model of a
run's newest good state, consolidated into one file that plain PyTorch loads.

The state is found as a resume finds it (:func:`virtualflow.launching.resume.find_resume_state`:
``final.pt``, ``checkpoint.pt``, ``checkpoints/step-N.pt`` or a sharded ``checkpoints/step-N.dcp``
folder, the newest good one; damaged ones are reported and skipped). A sharded checkpoint's
chunks are reassembled whatever the number of workers that wrote them. ``.safetensors`` needs the
``safetensors`` package (``pip install virtualflow[export]``); ``.pt`` is a plain ``state_dict``
(``torch.load(path, weights_only=True)``).

Tied weights (one tensor under two names, as a language model's embedding and output matrix):
a ``.pt`` file keeps them one tensor (``torch.save`` does). safetensors stores no shared tensors,
so a ``.safetensors`` file holds each such tensor once, under its first name, and records the
other names in its metadata, as :func:`safetensors.torch.save_model` does (``"aliases"``: a JSON
object ``{alias: kept name}``). Load it into the model with
``safetensors.torch.load_model(model, path)`` (it ties the names the model ties), or restore the
names of a plain ``load_file``'s dict from the metadata (docs/elasticity.md shows both).
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import torch

from virtualflow.launching.resume import find_resume_state
from virtualflow.records.rundir import atomic_write
from virtualflow.runtime.checkpoint import load_state, shared_names
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
        kept, aliases = untied(model)
        metadata = {"source": os.path.abspath(path), "step": str(step)}
        if aliases:
            metadata["aliases"] = json.dumps(aliases, sort_keys=True)
        atomic_write(to, st_save(kept, metadata=metadata))
    else:
        atomic_write(to, lambda f: torch.save(model, f))
    return path, step, len(model)


def untied(model: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """``model`` with each tied tensor under one name (its first), and ``{alias: kept name}`` of
    the names dropped; any other tensors that still share memory (views of one storage) are
    copied apart: a safetensors file holds no shared tensors."""
    aliases = shared_names(model)
    kept = {k: v for k, v in model.items() if k not in aliases}
    users: dict[tuple[Any, ...], int] = {}
    for v in kept.values():
        if v.numel():
            key = (v.device, v.untyped_storage().data_ptr())
            users[key] = users.get(key, 0) + 1
    return {k: v.clone() if v.numel() and users[(v.device, v.untyped_storage().data_ptr())] > 1 else v
            for k, v in kept.items()}, aliases


def main(args: argparse.Namespace) -> int:
    path, step, n = export_model(args.run_dir, args.to)
    print(f"wrote {args.to}: {n} tensors of the model at step {step}, from {path}")
    return 0
