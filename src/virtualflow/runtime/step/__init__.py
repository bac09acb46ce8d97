"""The parts of one optimizer step that every layout uses (the VN engine and the pipeline's stages).

- :mod:`.reduction`: how a step's gradients and the small vectors that ride with them are summed
  over the workers (all-reduce in buckets, sharded reduce-scatter, the deterministic tree over
  slots or owners), chosen once per generation, and where the summed gradient ends up; the
  ``[BatchNorm statistics | loss]`` tail after the gradients, read the same way by every layout.
- :mod:`.exchange`: the deterministic exchange's choice (``owners`` / ``slots``) and the
  ``owners`` exchange built for one vector layout.
- :mod:`.stats`: the VN engine's per-step statistics vector (its typed layout, packing and
  reading) and the loss function's metric sums.
- :mod:`.compute`: one VN's batch, forward, weighted loss and backward on a worker (and the probe
  VN a worker with no VN times).
"""
