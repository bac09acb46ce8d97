"""Reading back what the trackers wrote, for the logger tests: an MLflow run's metric histories
(through MLflow's own client) and a wandb offline run's history rows (its ``.wandb`` file)."""

from __future__ import annotations

import glob
import json
import os
import struct


def mlflow_histories(tracking_uri: str) -> dict[str, dict]:
    """run id -> {"status", "params", "metrics": {name: [(step, value), ...]}} for every run."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    out = {}
    for exp in client.search_experiments():
        for run in client.search_runs([exp.experiment_id]):
            rid = run.info.run_id
            out[rid] = {"status": run.info.status, "params": dict(run.data.params), "experiment": exp.name,
                        "metrics": {k: sorted((m.step, m.value) for m in client.get_metric_history(rid, k))
                                    for k in run.data.metrics}}
    return out


def wandb_offline_rows(wandb_dir: str) -> dict[str, list[dict]]:
    """run folder -> the history rows of each offline run under ``wandb_dir``, read from its
    ``run-<id>.wandb`` file: a LevelDB-style log (a 7-byte ``:W&B`` header, then 32 KiB blocks of
    records, each a 7-byte header -- CRC, length, kind: 1 whole, 2 first, 3 middle, 4 last --
    and a piece of a protobuf ``Record``)."""
    from wandb.proto import wandb_internal_pb2 as pb

    runs = {}
    for path in sorted(glob.glob(os.path.join(wandb_dir, "wandb", "offline-run-*", "run-*.wandb"))):
        data = open(path, "rb").read()
        assert data[:4] == b":W&B", data[:7]
        pos, block, rows, buf = 7, 32768, [], b""
        while pos + 7 <= len(data):
            left = block - pos % block
            if left < 7:  # a block's tail too short for a header is padding
                pos += left
                continue
            _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
            if length == 0 and kind == 0:
                pos += left
                continue
            chunk = data[pos + 7:pos + 7 + length]
            pos += 7 + length
            buf = chunk if kind in (1, 2) else buf + chunk
            if kind in (1, 4):
                record = pb.Record()
                record.ParseFromString(buf)
                if record.WhichOneof("record_type") == "history":
                    rows.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json)
                                 for i in record.history.item})
        runs[os.path.basename(os.path.dirname(path))] = rows
    return runs
