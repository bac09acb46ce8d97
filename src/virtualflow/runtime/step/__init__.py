"""A training step's concerns that every layout shares, one object each.

Where each concept lives:

======== ======================================================================================
finish   :class:`~.finish.StepFinish`: after the reduction, unscale (``16-mixed``), the inf/nan
         verdict, the whole step's gradient norm (:class:`~virtualflow.runtime.clipping.NormBlocks`),
         clip, skip and the loss scale's update; what a layout holds of the gradient is data
         (:class:`~.finish.WholeGrads`, :class:`~.finish.FlatSum`, :class:`~.finish.ChunkGrads`,
         a pipeline stage's :class:`~.finish.Part` s with :class:`~.finish.TensorSlots`)
update   the optimizer update, chosen once: :class:`~.update.WholeUpdate` (every worker holds
         the whole state) or :class:`~.update.ShardedUpdate` (ZeRO-1/2 chunks, replicas of
         them); zero_grad, apply, the state's read, gather, load, size and the regroup's gather
======== ======================================================================================

The VN engine (:mod:`virtualflow.runtime.engine`) and a pipeline stage's flush step
(:mod:`virtualflow.runtime.pipeline.flush`) both use them.
"""
