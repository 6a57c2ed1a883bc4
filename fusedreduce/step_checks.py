"""What ``DistributedOptimizer.step()`` refuses or warns of before it steps.

Each check runs before anything is stepped or communicated, so a refused
step leaves the parameters, the optimizer state and the reduced gradients
as they were. The step itself is the strategy's (``replicated_step``,
``sharded_step``); the optimizer calls these in ``step()``.
"""
from __future__ import annotations

import warnings

from . import join_scaling, uneven_inputs
from .clipping import refuse_scaled_clip, stepping_grad_scaler
from .kernels import refuse_in_capture
from .param_swap import params_of

__all__ = ["check_reduced", "check_reduced_once", "refuse_before_step"]

#: frames between a check here and the caller of ``step()``: this module's
#: function, then ``step()`` itself
_STEP_CALLER = 3


def refuse_before_step(opt, syncs_buffers: bool) -> None:
    """What no step of ``opt`` may run under: host-counted broadcasts in a
    CUDA graph capture, a clip of scaled gradients (looked at once, at the
    first step on reduced gradients), a ``GradScaler`` in a sharded
    ``Join``. ``syncs_buffers``: this step broadcasts ``buffers=``.

    Raises:
        RuntimeError: see ``DistributedOptimizer.step``.
    """
    if opt.bcast_period > 0:
        first = next((p for g in opt.param_groups for p in g["params"]), None)
        if first is not None:
            refuse_in_capture(
                first.device,
                f"a step with bcast_period={opt.bcast_period} (which steps broadcast is "
                f"counted on the host, so every replay would repeat the captured step's "
                f"choice)",
                "pass bcast_period=0 or -1, and call broadcast_parameters() between "
                "replays when the replicas should be re-synchronised")
    if opt._scaler_unchecked and opt.reducer.reduced:
        opt._scaler_unchecked = False
        refuse_scaled_clip(stepping_grad_scaler(_STEP_CALLER), opt.reducer.max_grad_norm,
                           opt.reducer.loss_scale, "DistributedOptimizer")
    if syncs_buffers:
        refuse_in_capture(
            opt._buffer_sync.buffer.device,
            "a step that broadcasts buffers= (rank 0's buffers after every step)",
            "pass bcast_period=-1 to the optimizer you capture, and call "
            "broadcast_buffers() between replays")
    if uneven_inputs.in_join(opt):
        # the scaler a rank follows once it runs out (frames are read inside
        # Join only: reading a frame's locals keeps them alive)
        join_scaling.record_scaler(opt, _STEP_CALLER)


def check_reduced_once(opt) -> None:
    """Backward passes that reduced again over gradients no step took:
    right where that gives the reduced sum (a warning, once: each
    reduction is a collective), refused where it does not.

    Raises:
        RuntimeError: a reduction again with ``shard=True``, a sum or AdaSum.
    """
    reducer = opt.reducer
    if not (reducer.reduced_again and reducer.reduced):
        return  # (a last pass that did not reduce is check_reduced's error)
    fix = (f"pass backward_passes_per_step equal to the backward passes of each step "
           f"(it is {opt.backward_passes_per_step}), or run all but the last of them "
           f"inside optimizer.no_sync()")
    if reducer.stacks_exactly:
        if not opt._warned_reduced_again:
            opt._warned_reduced_again = True
            if uneven_inputs.in_join(opt):
                # a rank that ran out shadows each reduction with zeros, not
                # with the reduced gradients the earlier passes left
                result = ("inside a Join context the result is not their reduced sum once "
                          "a rank has run out of data: it contributes zeros to each "
                          "reduction, so the earlier passes' reduced gradients are divided "
                          "by the world size again (as under DDP's join() without "
                          "no_sync())")
            else:
                result = "the result is their reduced sum, but each reduction is a collective"
            warnings.warn(f"backward passes reduced the gradients more than once before "
                          f"this step(): {result}; {fix}", stacklevel=4)
        return
    if opt.shard:
        why = "with shard=True each rank's .grad holds only its part of the reduced gradients"
    elif opt.reduce_method == "adasum":
        why = ("reduce_method='adasum' combines the gradients; combining combined ones is "
               "another result")
    else:
        why = (f"reduce_method={opt.reduce_method!r} does not divide by the world size, so "
               f"the next sum counts them once per rank")
    raise RuntimeError(
        f"a backward pass reduced the gradients again before step() took the previous "
        f"reduction (more backward passes since the last step() or zero_grad() than "
        f"backward_passes_per_step): {why}, so the gradients are not the passes' reduced "
        f"sum. Nothing was stepped; {fix}")


def check_reduced(opt) -> None:
    """Gradients that no backward reduced (called by the step strategy after
    a closure's backward).

    Raises:
        RuntimeError: some parameter has a ``.grad`` and the last backward
            pass did not reduce (``no_sync()``, or fewer passes than
            ``backward_passes_per_step``).
    """
    has_grads = any(p.grad is not None for p in params_of(opt))
    if has_grads and not opt.reducer.reduced:
        raise RuntimeError(
            "step() called on gradients that were not reduced across ranks: call it "
            f"after every {opt.backward_passes_per_step} backward pass(es), outside "
            f"no_sync()")
