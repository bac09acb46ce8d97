"""The parts of one optimizer step that every layout uses (the VN engine and the pipeline's stages),
one object each, chosen once (per run or per generation) so that the training path asks the
object instead of the layout.

- :mod:`.reduction`: how a step's gradients and the small vectors that ride with them are summed
  over the workers (all-reduce in buckets, sharded reduce-scatter, the deterministic tree over
  slots or owners), chosen once per generation, and where the summed gradient ends up; the
  ``[BatchNorm statistics | loss]`` tail after the gradients, read the same way by every layout.
- :mod:`.exchange`: the deterministic exchange's choice (``owners`` / ``slots``) and the
  ``owners`` exchange built for one vector layout (the VN engine's and a pipeline stage group's).
- :mod:`.finish`: :class:`~.finish.StepFinish`, after the reduction: unscale (``16-mixed``), the
  inf/nan verdict, the whole step's gradient norm (:class:`~virtualflow.runtime.clipping.NormBlocks`),
  clip, skip and the loss scale's update; what a layout holds of the gradient is data
  (:class:`~.finish.WholeGrads`, :class:`~.finish.FlatSum`, :class:`~.finish.ChunkGrads`, a
  pipeline stage's parts with :class:`~.finish.TensorSlots`).
- :mod:`.update`: the optimizer update, chosen once: :class:`~.update.WholeUpdate` (every worker
  holds the whole state) or :class:`~.update.ShardedUpdate` (ZeRO-1/2 chunks, replicas of them):
  zero_grad, apply, the state's read, gather, load, size and the regroup's gather.
- :mod:`.stats`: the VN engine's per-step statistics vector (its typed layout, packing and
  reading) and the loss function's metric sums.
- :mod:`.compute`: one VN's batch, forward, weighted loss and backward on a worker (and the probe
  VN a worker with no VN times).

The VN engine (:mod:`virtualflow.runtime.engine`) and a pipeline stage's flush step
(:mod:`virtualflow.runtime.pipeline.flush`) both use them.
"""
