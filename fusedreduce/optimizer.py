"""Optimizer wrappers: the wrapped optimizer steps on data-parallel results.

- ``DistributedOptimizer``: gradients averaged (or summed) across ranks through
  fused buckets overlapped with backward. PyTorch counterpart of MegEngine's
  ``DistributedOptimizer`` (``reduce_method``, ``param_pack``/``param_pack_thd``,
  ``bcast_period``) with Horovod's ``backward_passes_per_step``.
- ``AdaSumByDeltaWeight`` (``adasum_delta``, re-exported here): each rank
  steps locally, then the weight deltas are combined with AdaSum.

Both return an object that *is* an instance of the wrapped optimizer's class
(it takes over its parameter groups and state), so learning-rate schedulers,
``torch.amp.GradScaler`` and ``state_dict()``/``load_state_dict()`` work as with
the original.

``DistributedOptimizer`` is a shell: its options are checked and its step
strategy built in ``optimizer_options``; the strategy (``replicated_step``,
``sharded_step``) owns the reducer, the step body, clipping and the
sharded mode's parameters; ``optimizer_checkpoint`` holds the state dicts,
the checkpoint files and the checkpoint methods (``CheckpointMethods``);
``step_checks`` what ``step()`` refuses. What stays here is what every
mode shares: the class swap, the broadcasts, ``step()`` and its counting.
"""
from __future__ import annotations

import functools
import operator
from datetime import timedelta
from typing import Iterable, Optional, Union

import torch
import torch.distributed as dist

from . import optimizer_checkpoint as checkpoints, step_checks, uneven_inputs
from .adasum_delta import AdaSumByDeltaWeight
from .broadcast import broadcast_tensors
from .buckets import FlatBuffers
from .clipping import check_error_if_nonfinite, check_limit, check_norm_type
from .optimizer_options import build_step, check_options, check_ranks_agree
from .param_swap import instance_of_both, params_of
from .sharded import ShardLayout

__all__ = ["AdaSumByDeltaWeight", "DistributedOptimizer"]

#: the options kept as attributes of the optimizer, as they were given
_KEPT = ("group", "reduce_method", "bcast_period", "backward_passes_per_step",
         "find_unused_parameters", "shard", "shard_gradients", "master_dtype",
         "overlap_param_gather")


class DistributedOptimizer(uneven_inputs.JoiningOptimizer, checkpoints.CheckpointMethods,
                           torch.optim.Optimizer):
    """Make ``optimizer`` step on gradients reduced across the process group.

    The returned object *is* an instance of the wrapped optimizer's class (it
    takes over its parameter groups and state), so learning-rate schedulers,
    ``torch.amp.GradScaler``, ``state_dict()``/``load_state_dict()`` work as
    with the original. Use it instead of the original from then on.

    Gradients are reduced during ``loss.backward()``: each fused bucket's
    all-reduce starts as soon as its gradients are ready, and when backward
    returns every ``.grad`` holds the reduced gradient, bitwise identical on
    all ranks (so a GradScaler sees the same infs everywhere and skips the same
    steps). ``step()`` then runs the wrapped optimizer.

    The trained set may change between steps: ``add_param_group`` adds to
    the reduction (and broadcasts the new parameters unless ``bcast_period``
    is -1), and parameters frozen or unfrozen with ``requires_grad_`` are
    followed at the next ``step()`` (see ``add_param_group`` and ``step``).
    A parameter without a gradient on some rank in a step (a branch not
    taken there) contributes zeros to the reduction, as in DDP. By default
    (``find_unused_parameters=False``, DDP's default too) nothing is checked
    beyond that: a parameter that *no* rank gave a gradient gets a zero
    ``.grad``, so the wrapped optimizer steps it (weight decay, momentum),
    and the first backward in which this rank misses a gradient warns
    (decided locally: no read, no collective). ``find_unused_parameters=True``
    leaves such a parameter ``.grad = None`` on every rank, so the wrapped
    optimizer skips it as torch does (as
    ``DistributedDataParallel(find_unused_parameters=True)`` leaves it).
    ``None`` against a tensor is a decision the host makes, so it needs the
    ranks' answer on the host: each bucket's all-reduce carries, in one spare
    element, how many ranks missed one of its gradients, and one host read
    after backward checks it (on a GPU, a synchronisation at every backward,
    and no CUDA graph capture); a backward where some rank missed one adds a
    small all-reduce that counts who had each gradient (AdaSum, whose combine
    is not a sum, adds it at every backward). That per-step cost is why it is
    not the default.

    ``shard=True`` (ZeRO on the fused buckets): each bucket is split into one
    contiguous part per rank (padding at bucket ends only); during backward
    each bucket is reduce-scattered as soon as it is ready, and afterwards
    each ``.grad`` holds the reduced gradient on the elements this rank owns
    and zeros elsewhere; ``step()`` runs the wrapped optimizer on this rank's
    part only (16-bit parameters through ``master_dtype`` copies of that
    part), then all-gathers the parts into the parameters (one collective per
    bucket, in the parameters' own dtype), bitwise identical on every rank.
    ``optimizer.state`` holds this rank's part: whole tensors for the
    parameters it owns wholly, 1-D slices for those a part boundary cuts.
    ``state_dict()`` is then collective and returns the whole, unsharded
    state; ``sharded_state_dict()`` gives this rank's part alone, for one
    checkpoint file per rank that loads at any world size.
    ``torch.nn.utils.clip_grad_norm_`` left in the loop takes the whole
    gradient's norm from the shares (collective; torch >= 2.6, see
    docs/guides/clipping.md), as ``clip_grad_norm_()`` and ``max_grad_norm``
    do. Only optimizers whose step is elementwise can be sharded (see
    ``assume_elementwise``). On gloo the reduce-scatter is an all-reduce whose
    part is kept (gloo's own reduce-scatter all-reduces inside, slower).
    ``shard_gradients=True`` shards the gradients too (ZeRO-2): each
    bucket's ``.grad`` tensors are released as soon as the bucket has read
    them, during backward, and afterwards only the parameters this rank
    owns elements of have a ``.grad`` (the others keep ``None``); the flat
    buffers live only while a backward or an all-gather uses them.

    Args:
        optimizer: any ``torch.optim.Optimizer``.
        reduce_method: ``"mean"`` or ``"sum"`` across ranks, or ``"adasum"``
            (Horovod's ``op=Adasum``): each bucket's gradients combine along
            AdaSum's tree during backward, bitwise ``adasum_allreduce`` of the
            gradients (per-parameter coefficients).
        group: the process group; default: the world.
        bcast_period: ``0``: broadcast the parameters (and ``buffers``) from
            rank 0 of ``group`` (a group rank) once, now; ``k > 0``: the
            parameters also every ``k`` steps (restores diverged replicas);
            ``-1``: never, neither parameters nor buffers: the parameters
            must then be equal already, which this constructor checks (a
            checksum in the rank check it makes anyway) and raises on every
            rank if not. ``buffers`` are broadcast after every step unless
            ``-1``.
        param_pack: fuse gradients into buckets (``False``: one all-reduce per
            gradient).
        param_pack_thd: the byte cap of a fused bucket.
        backward_passes_per_step: reduce on every this-many backward passes,
            accumulating locally in between (call ``step()`` after the last).
        reduce_dtype: the communication dtype (see ``DistributedGradReducer``).
        gradient_as_bucket_view: keep each ``.grad`` as a view of its fused
            bucket (DDP's option; see ``DistributedGradReducer.register_hooks``):
            no flatten copy, one gradient copy less in memory, same results.
        local_size: ranks per node, contiguous in the group's rank order
            (under torchrun ``int(os.environ["LOCAL_WORLD_SIZE"])``). With
            ``reduce_method="adasum"``: average inside consecutive blocks of
            this many ranks first (a node's GPUs), then AdaSum across the
            blocks, as ``hooks.adasum_hook``'s ``local_size``. With "mean" or
            "sum": the node-aware reduction (``DistributedGradReducer``'s
            ``local_size``: inside the node, this rank's part across nodes,
            gathered inside the node; docs/guides/across-nodes.md). With
            ``shard=True``: reduce-scattered inside the node, then across
            nodes; the state stays sharded over the whole group, and rank
            ``r`` owns part ``(r % local_size) * nodes + r // local_size``
            of each bucket (``layout``). 1 (default): the flat reduction,
            today's bits.
        wire_dtype: ``DistributedGradReducer``'s (with "mean"/"sum"): the
            compressed wire format of the cross-node sum (with ``shard``, of
            the gradients' reduce-scatter; the parameters' all-gather stays
            in their dtype).
        deterministic: ``DistributedGradReducer``'s: the all-to-all sum in
            fp32, the same bits whatever the bucket cap and topology.
        error_feedback: ``DistributedGradReducer``'s: the quantization error
            of a compressing ``wire_dtype`` kept and added at the next step
            (saved by ``sharded_state_dict()``, per rank).
        shard: shard the optimizer state and master weights across the group
            (see above); AdaSum stops its tree after the halving, each rank
            steps the slice it holds there, and the tree's reverse swaps
            gather the parameters.
        shard_gradients: with ``shard=True``, keep only this rank's share of
            the reduced gradients (ZeRO-2): ``.grad`` of a parameter this rank
            owns wholly is its reduced gradient, of one a part boundary cuts
            the reduced gradient on the owned elements and zeros elsewhere, of
            any other ``None`` (a rank whose share has no gradient keeps a
            zero ``.grad`` on one parameter for ``GradScaler``). The steps
            are bitwise those of ``shard_gradients=False``; between the
            backward passes of ``backward_passes_per_step`` the gradients
            accumulate full-size, as without it. The flat buffers are not
            kept between steps either: a bucket's is made when backward
            starts it and dropped once its reduce-scatter has finished
            (waited for when the bucket after next starts, so at most two
            are alive at once), this rank's part of it until ``.grad`` is
            written; the all-gather's (in the parameters' dtype) lives until
            the parameters are written, so forward's activations can use
            that memory.
        master_dtype: with ``shard=True``, the dtype 16-bit parameters are
            stepped in (their optimizer state is kept in it too); wider
            parameters are stepped in their own dtype.
        assume_elementwise: with ``shard=True``, accept an optimizer class
            fusedreduce does not know to be elementwise (its step must update
            each element from that element's gradient and state alone).
        overlap_param_gather: with ``shard=True``, leave ``step()``'s
            all-gathers in flight: each bucket is written into the parameters
            when a module owning one of them starts its next forward (a
            global forward pre-hook), overlapping the gather with whatever
            comes between and with the forward itself (Megatron's and FSDP2's
            prefetch). Parameters read outside a module's forward need
            ``finish_param_gather()`` first.
        gradient_collective: with ``shard=True`` (not AdaSum), how each
            bucket leaves every rank its part of the reduced gradient:
            ``"reduce_scatter"`` (NCCL's default), ``"all_reduce"`` (the
            whole bucket all-reduced, the part kept: gloo's default, where
            the reduce-scatter all-reduces inside and is slower) or
            ``"exchange"`` (on 2 ranks, every host bucket neither prescaled
            nor cast goes by one exchange of the ranks' halves, the others
            are all-reduced; gloo's default does so for buckets of few large
            tensors only). None (default): chosen from the process group's
            backend (with ``local_size`` > 1, ``wire_dtype`` or
            ``deterministic``: the all-to-all sum on gloo, ``"reduce_scatter"``
            per level on NCCL). For tests
            and benchmarks (NCCL's path on gloo ranks, say): either leaves
            the ranks bitwise alike (the two may differ from each other by
            the rounding of another summation order); a world of one rank
            communicates nothing.
        parameter_gather: with ``shard=True`` (not AdaSum), how the stepped
            parts come back into every rank's parameters: ``"all_gather"``
            (one per bucket into its buffer, then written into the
            parameters: NCCL's default); ``"broadcast"`` (one broadcast per
            rank's part instead, gloo's default, whose all-gather copies
            through a temporary; a bucket of one dtype whose contiguous
            tensors hold 2**17 elements or more on average goes by one
            broadcast per tensor range straight into the parameters);
            ``"broadcast_direct"`` (as ``"broadcast"``, every bucket of one
            dtype and contiguous parameters straight into them, whatever
            their size). None (default): chosen from the process group's
            backend. For tests and benchmarks; each gives the same
            parameters (the gathers copy bits).
        backend: the kernels' backend, as ``DistributedGradReducer``'s:
            ``"auto"`` (default: Triton on CUDA tensors, torch's ops
            elsewhere), ``"triton"`` or ``"torch"`` (``kernels``).
        max_grad_norm: clip the reduced gradients to this total norm in the
            pass that writes them back (``DistributedGradReducer``'s
            option; with ``shard=True`` the norm of every rank's part and one
            small all-reduce). ``grad_norm`` then holds the total norm before
            clipping (fp32, or fp64 when a parameter is fp64, as torch's).
            None (default): no clipping; ``math.inf``: the norm measured into
            ``grad_norm``, the gradients unchanged.
        norm_type: the clipping norm's order (``math.inf`` or ``'inf'``: the max
            norm), positive: ``clipping.check_norm_type``.
        error_if_nonfinite: raise from the backward pass if the total norm is
            inf or NaN, before any gradient is written back.
        split_norm: without ``shard``, ``DistributedGradReducer``'s option:
            each rank reads ``1 / world_size`` of the reduced buffers for the
            clipping norm (None: when they are large enough). With
            ``shard=True`` the norm is always split so (each rank reads its
            part); the argument changes nothing there.
        find_unused_parameters: ``False`` (default, as DDP's): no count; a
            parameter without a gradient on a rank contributes zeros, one
            that no rank had a gradient for gets a zero ``.grad`` (the
            optimizer then steps it: weight decay, momentum), and the first
            backward where this rank misses one warns. ``True``: find the
            parameters no rank gave a gradient in a step and leave their
            ``.grad`` None (above), at one host read per backward.
        buffers: tensors to keep equal to group rank 0's, as DDP's
            ``broadcast_buffers=True`` does: ``model.buffers()`` (BatchNorm's
            running statistics, which each rank's forward updates from its
            own batch). Broadcast now and after every ``step()`` (all of
            them packed into one broadcast, bitwise; ``broadcast_buffers()``
            does it on demand), unless ``bcast_period`` is -1. The
            optimizer never sees the module, so the default ``None`` keeps
            none in sync: each rank's statistics stay its own.
        checkpoint_timeout: with ``shard=True``, how long (seconds, or a
            ``datetime.timedelta``) a collective checkpoint call
            (``state_dict()``, ``add_param_group()``) waits for the other
            ranks to call it too before it raises, and the most each of its
            operations may take. None (default): 60 s. Those calls
            communicate on a gloo group of their own over the same ranks
            (made here, under NCCL too), never between the training
            collectives of ranks that did not make the call.

    Raises:
        ValueError: ``reduce_method`` is not "sum", "mean" or "adasum"; a bad
            ``bcast_period``, ``param_pack_thd`` or ``backward_passes_per_step``;
            ``local_size`` not dividing the world size;
            ``wire_dtype`` or ``deterministic`` with AdaSum, and
            ``DistributedGradReducer``'s errors for them; with ``shard=True``
            and ``local_size`` > 1, ``wire_dtype`` or ``deterministic``:
            ``gradient_collective`` "all_reduce" or "exchange",
            "reduce_scatter" with ``wire_dtype`` or ``deterministic``, or
            ``parameter_gather`` "broadcast"/"broadcast_direct" over more
            than one node; a 16-bit ``reduce_dtype`` with AdaSum; ``shard=True``
            with an optimizer not known to be elementwise (LBFGS, ...) unless
            ``assume_elementwise``, or with ``gradient_as_bucket_view``;
            ``overlap_param_gather``, ``shard_gradients``,
            ``checkpoint_timeout``, ``gradient_collective`` or
            ``parameter_gather`` without ``shard``; ``gradient_collective``
            or ``parameter_gather`` not a value listed above, or given with
            AdaSum; ``backend`` not ``"auto"``, ``"triton"`` or ``"torch"``;
            ``checkpoint_timeout`` not above zero; a tensor twice in
            ``buffers``, or one of the parameters there.
        TypeError: ``optimizer`` is not a ``torch.optim.Optimizer``;
            ``shard``, ``shard_gradients``, ``find_unused_parameters``,
            ``param_pack``, ``gradient_as_bucket_view``,
            ``assume_elementwise`` or ``overlap_param_gather`` is not a bool
            (a string ``"False"`` included); ``master_dtype`` is not a
            floating dtype (with or without ``shard``);
            ``checkpoint_timeout`` is neither seconds nor a timedelta;
            ``gradient_collective`` or ``parameter_gather`` is neither None
            nor a string;
            ``buffers`` is not an iterable of dense tensors (a module, say).
        RuntimeError: torch.distributed is not initialised; the ranks of
            ``group`` pass different ``bcast_period`` values, parameter or
            ``buffers`` shapes, or (with ``bcast_period=-1``) parameter
            values (raised on every rank, before any broadcast; the other
            options are compared at the first reducing backward, before any
            gradient is written).

    Examples:
        >>> opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))  # doctest: +SKIP
        >>> loss.backward(); opt.step(); opt.zero_grad()          # doctest: +SKIP
        >>> zero = DistributedOptimizer(torch.optim.AdamW(model.parameters()), shard=True)  # doctest: +SKIP
        >>> zero2 = DistributedOptimizer(torch.optim.AdamW(model.parameters()), shard=True,
        ...                              shard_gradients=True)  # doctest: +SKIP
        >>> opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
        ...                            buffers=model.buffers())  # doctest: +SKIP
    """

    def __new__(cls, optimizer: torch.optim.Optimizer, *args, **kwargs):
        return instance_of_both(cls, optimizer)

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        reduce_method: str = "mean",
        group: Optional[dist.ProcessGroup] = None,
        bcast_period: int = 0,
        param_pack: bool = True,
        param_pack_thd: int = 10 * 1024 * 1024,
        backward_passes_per_step: int = 1,
        *,
        reduce_dtype: torch.dtype = torch.float32,
        gradient_as_bucket_view: bool = False,
        local_size: int = 1,
        wire_dtype: Optional[torch.dtype] = None,
        deterministic: bool = False,
        error_feedback: bool = False,
        shard: bool = False,
        shard_gradients: bool = False,
        master_dtype: torch.dtype = torch.float32,
        assume_elementwise: bool = False,
        overlap_param_gather: bool = False,
        max_grad_norm: Optional[float] = None,
        norm_type: Union[float, str] = 2.0,
        error_if_nonfinite: bool = False,
        find_unused_parameters: bool = False,
        split_norm: Optional[bool] = None,
        buffers: Optional[Iterable[torch.Tensor]] = None,
        checkpoint_timeout: Union[float, timedelta, None] = None,
        gradient_collective: Optional[str] = None,
        parameter_gather: Optional[str] = None,
        backend: str = "auto",
    ) -> None:
        options = check_options(
            optimizer, reduce_method=reduce_method, group=group, bcast_period=bcast_period,
            param_pack=param_pack, param_pack_thd=param_pack_thd,
            backward_passes_per_step=backward_passes_per_step, reduce_dtype=reduce_dtype,
            gradient_as_bucket_view=gradient_as_bucket_view, local_size=local_size,
            wire_dtype=wire_dtype, deterministic=deterministic, error_feedback=error_feedback,
            shard=shard, shard_gradients=shard_gradients, master_dtype=master_dtype,
            assume_elementwise=assume_elementwise, overlap_param_gather=overlap_param_gather,
            max_grad_norm=max_grad_norm, norm_type=norm_type,
            error_if_nonfinite=error_if_nonfinite,
            find_unused_parameters=find_unused_parameters, split_norm=split_norm,
            buffers=buffers, checkpoint_timeout=checkpoint_timeout,
            gradient_collective=gradient_collective, parameter_gather=parameter_gather,
            backend=backend)
        self.__dict__.update(optimizer.__dict__)
        for name in _KEPT:
            setattr(self, name, getattr(options, name))
        self._steps = 0
        self._warned_reduced_again = False
        # a finite clip under a GradScaler needs loss_scale: looked at (the
        # calling frames) until the first step on reduced gradients
        self._scaler_unchecked = options.clips
        self._buffer_sync = options.buffer_sync
        # the reducer checks the parameters (before any collective)
        self._step = build_step(self, options)
        try:
            check_ranks_agree(self._all_params(), options)
            if bcast_period != -1:
                self.broadcast_parameters()
                self.broadcast_buffers()
            self._step.connect()
        except Exception:
            self.reducer.remove_hooks()  # the caller's parameters keep no hook of ours
            raise
        # the masters are taken from the broadcast parameters
        self._step.start(self)

    @property
    def reducer(self):
        """The gradient reducer hooked on the parameters: a
        ``DistributedGradReducer`` (``AdaSumReducer`` with AdaSum,
        ``ShardedGradReducer`` with ``shard=True``), made again when the
        trained set changes. For reading its state; ``step()`` drives it.

        Examples:
            >>> opt.reducer.world_size   # doctest: +SKIP
            2
        """
        return self._step.reducer

    @property
    def sharded(self):
        """With ``shard=True``: this rank's ``ShardedParameters`` (its slices of
        the parameters, their masters, the gathers); None without ``shard``.
        For reading; ``step()`` drives it.

        Examples:
            >>> len(opt.sharded.masters)   # slices stepped through a master  # doctest: +SKIP
        """
        return self._step.sharded

    @property
    def grad_norm(self) -> Optional[torch.Tensor]:
        """With ``max_grad_norm``: the total norm of the gradients the last
        reducing backward produced, before clipping (0-d on their device,
        fp32, or fp64 when a parameter is fp64, the same bits on every rank,
        as ``clip_grad_norm_`` returns it: ``clipping.norm_dtype_of``); None
        before the first one, or without clipping."""
        return self.reducer.grad_norm

    @property
    def buffer_bytes(self) -> int:
        """Bytes of the flat buffers fusedreduce keeps for this optimizer from
        one step to the next, each piece of memory counted once (what a
        memory plan adds to the parameters, ``.grad`` and the optimizer
        state): one buffer per bucket in its communication dtype
        (``DistributedGradReducer.buffer_bytes``), 4 bytes per parameter
        element for 16-bit and fp32 parameters alike by default. With
        ``shard=True`` they are made at construction and kept whole; this
        rank's part of each and the all-gather live in them (both
        collectives run in place), so sharding adds nothing here
        (docs/guides/sharded.md, "Memory per rank"). With
        ``shard_gradients=True`` none is kept: 0 between steps, the
        buckets started so far during backward, and the all-gather's
        buffers while ``overlap_param_gather`` leaves them in flight. With
        ``wire_dtype`` or ``deterministic`` (sharded or not), the
        collective's kept codes, received chunks, block scales and error
        feedback's residuals are counted too.

        Examples:
            >>> opt = DistributedOptimizer(torch.optim.AdamW(model.parameters()),  # doctest: +SKIP
            ...                            shard=True)
            >>> opt.buffer_bytes / sum(p.numel() for p in model.parameters())  # doctest: +SKIP
            4.0   # fp32 buckets (their padding aside)
        """
        return self._step.buffer_bytes

    @property
    def layout(self) -> Optional[ShardLayout]:
        """With ``shard=True``: which elements of which bucket and parameter
        this rank owns (``sharded.ShardLayout``: the plan, each bucket's
        owned range, each parameter's owned elements), the table the
        sharded step, ``.grad``'s write-back and ``optimizer.state`` follow;
        None without ``shard``. Read-only data, made at construction (again
        by ``add_param_group``).

        Examples:
            >>> opt = DistributedOptimizer(torch.optim.AdamW(model.parameters()),  # doctest: +SKIP
            ...                            shard=True)
            >>> owned = opt.layout.range_of(0)   # parameter 0's elements here  # doctest: +SKIP
            >>> model.weight.grad.view(-1)[owned.start:owned.end]             # doctest: +SKIP
        """
        return self._step.layout

    @property
    def flat_buffers(self) -> FlatBuffers:
        """The flat buffers this optimizer holds, by role and bucket
        (``buckets.FlatBuffers``: the reduction's, this rank's parts and the
        all-gather's with ``shard=True``, the bucket views' buffers), as the
        tensor objects: the memory ``buffer_bytes`` counts, for memory
        accounting, tests and benchmarks. Read them, never write them.

        Examples:
            >>> opt = DistributedOptimizer(torch.optim.AdamW(model.parameters()),  # doctest: +SKIP
            ...                            shard=True, shard_gradients=True)
            >>> [b.untyped_storage().nbytes() for b in opt.flat_buffers.gradients]  # doctest: +SKIP
            [0, 0, 0]   # given back between steps
        """
        return self._step.flat_buffers

    @property
    def param_gather_in_flight(self) -> bool:
        """With ``overlap_param_gather=True``: whether all-gathers that
        ``step()`` left in flight have not all been written into the
        parameters yet (the next forward, ``finish_param_gather()`` or any
        call that needs the parameters writes them); False otherwise.

        Examples:
            >>> opt.step(); opt.param_gather_in_flight        # doctest: +SKIP
            True
            >>> _ = model(x); opt.param_gather_in_flight      # doctest: +SKIP
            False
        """
        return self._step.param_gather_in_flight

    @property
    def loss_scale(self):
        """With ``max_grad_norm`` under a GradScaler: the scale the gradients
        carry (set it before each backward to
        ``scaler.scale(torch.ones((), device=...))``, a device tensor: no host
        sync), so the limit applies to the unscaled norm; the gradients stay
        scaled for ``scaler.step``. None: unscaled gradients.

        Raises:
            TypeError: when set to anything but None, a Python number (bools
                excluded) or a floating tensor.
            ValueError: when set to a number that is not finite and > 0, or a
                tensor of more than one element or on the meta device. A
                tensor's value is not read: one that is not finite and > 0
                makes ``grad_norm`` NaN (see the clipping guide).
        """
        return self.reducer.loss_scale

    @loss_scale.setter
    def loss_scale(self, value) -> None:
        self.reducer.loss_scale = value

    def _all_params(self):
        return params_of(self)

    def _check_between_steps(self, what: str) -> None:
        if uneven_inputs.in_join(self):
            raise RuntimeError(
                f"{what} inside a Join context: a rank that ran out of data shadows the "
                f"passes of the parameters trained when it joined; change the trained set "
                f"outside the context")
        if self.reducer.accumulated_passes or not self.reducer.syncing:
            raise RuntimeError(
                f"{what} between the backward passes of one step (inside no_sync() or before "
                f"the last of backward_passes_per_step={self.backward_passes_per_step}): the "
                f"gradients accumulated so far would not be reduced alike; do it after step()")

    def add_param_group(self, param_group: dict) -> None:
        """``torch.optim.Optimizer.add_param_group``, and the group's trainable
        parameters join the reduction from the next backward on. Every rank
        must call it alike (it is collective): unless ``bcast_period`` is
        -1, the new parameters are broadcast from the group's rank 0 at once, as the
        others were when the optimizer was wrapped.

        Raises:
            RuntimeError: called between the backward passes of one step
                (inside ``no_sync()``, or before the last of
                ``backward_passes_per_step``); nothing is changed. With
                ``shard=True``, not every rank called it within
                ``checkpoint_timeout`` (as ``state_dict()``); nothing is
                changed.
            TypeError, ValueError: as ``torch.optim.Optimizer.add_param_group``
                raises them.

        Examples:
            >>> opt.add_param_group({"params": head.parameters(), "lr": 1e-3})  # doctest: +SKIP
        """
        if self.__dict__.get("_step") is None:  # torch.optim.Optimizer's own construction
            super().add_param_group(param_group)
            return
        self._check_between_steps("add_param_group() called")
        self._step.add_param_group(self, functools.partial(self._add_group, param_group))

    def _add_group(self, param_group: dict) -> None:
        """The wrapped optimizer's ``add_param_group``, and the new parameters
        broadcast unless ``bcast_period`` is -1."""
        super().add_param_group(param_group)
        added = self.param_groups[-1]["params"]
        if self.bcast_period != -1 and added:
            with torch.no_grad():
                first = len(self._all_params()) - len(added)
                broadcast_tensors([p.data for p in added], 0, group=self.group,
                                  names=[f"parameters[{first + i}]" for i in range(len(added))])

    def _follow_requires_grad(self) -> None:
        """Parameters frozen or unfrozen since the last step: the strategy
        follows them (``follow``)."""
        now = [p for p in self._all_params() if p.requires_grad]
        trainable = self._step.trainable
        if len(now) == len(trainable) and all(map(operator.is_, now, trainable)):
            return
        self._check_between_steps("parameters were frozen or unfrozen")
        self._step.follow(self, now)

    def broadcast_buffers(self) -> None:
        """Copy the ``buffers`` of rank 0 of the optimizer's group to every
        rank of it (one fused broadcast, bitwise exact; collective). ``step()``
        does it after every step unless ``bcast_period`` is -1; call it
        yourself between the replays of a captured step, or with
        ``bcast_period=-1`` when the buffers should agree. Without
        ``buffers`` it does nothing.

        Examples:
            >>> opt.broadcast_buffers(); model.eval()   # rank 0's statistics  # doctest: +SKIP
        """
        self._buffer_sync()

    def broadcast_parameters(self, src: int = 0) -> None:
        """Copy the parameters of rank ``src`` of the optimizer's group (a group
        rank) to every rank of it (fused, bitwise exact)."""
        self.finish_param_gather()
        params = self._all_params()
        with torch.no_grad():
            # verified first: a rank with a differently shaped parameter gets a
            # RuntimeError naming it (on every rank), not a crashed broadcast
            broadcast_tensors([p.data for p in params], src, group=self.group,
                              names=[f"parameters[{i}]" for i in range(len(params))])
        # written through .data, which moves no version counter
        self.reload_master_weights()

    def finish_param_gather(self) -> None:
        """With ``overlap_param_gather=True``: finish the parameters' all-gathers
        that ``step()`` left in flight, now.

        Each bucket is otherwise written when a module owning one of its
        parameters starts its forward. Call this before reading parameters
        outside a module's forward (``model.state_dict()`` right after
        ``step()``, an evaluation through ``torch.func``, a weight norm
        logged); ``step()``, ``state_dict()`` and the next reducing backward
        call it themselves. Without deferred gathers it does nothing.

        Examples:
            >>> opt.step(); opt.finish_param_gather(); torch.save(model.state_dict(), "m.pt")  # doctest: +SKIP
        """
        self._step.finish_param_gather()

    def clip_grad_norm_(self, max_norm: float, norm_type: Union[float, str] = 2.0,
                        error_if_nonfinite: bool = False,
                        foreach: Optional[bool] = None) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over the reduced gradients of
        this optimizer's parameters, the same on every rank.

        Call it after backward (and after ``GradScaler.unscale_``) and before
        ``step()``. Without sharding every rank holds the whole reduced
        gradient and this is torch's function on it. With ``shard=True``
        each rank holds its share: the norm is taken over the shares and
        combined with one scalar all-reduce (collective: every rank calls
        it), so it is the whole gradient's norm, bitwise the same on every
        rank, and each share is scaled by the same coefficient. Each share's
        norm is taken in its dtype, as torch takes each gradient's, and they
        are combined in fp64; the norm and the coefficient are fp32, or fp64
        when a parameter is fp64, as torch's.

        ``norm_type`` may be ``'inf'``, as torch's; orders of 0 and below are
        refused (see ``clipping.check_norm_type``). ``foreach`` goes to
        torch's function without sharding; the shares are always scaled
        with one foreach multiply.

        Returns:
            The total norm (a 0-d tensor, as torch's; 0 with no gradients).

        Raises:
            TypeError: ``max_norm`` or ``norm_type`` is not a number (or
                ``'inf'``), or ``error_if_nonfinite`` is not a bool.
            ValueError: ``max_norm`` is not positive (``math.inf`` measures
                the norm and scales by exactly 1, as torch's), or
                ``norm_type`` is not positive.
            RuntimeError: ``error_if_nonfinite`` and the norm is inf or NaN
                (on every rank alike); nothing is scaled.

        Examples:
            >>> loss.backward(); opt.clip_grad_norm_(1.0); opt.step()   # doctest: +SKIP
        """
        max_norm = check_limit(max_norm, "max_norm")
        uneven_inputs.refuse_in_sharded_join(self, "clip_grad_norm_() (collective with shard=True)")
        norm_type = check_norm_type(norm_type)
        check_error_if_nonfinite(error_if_nonfinite)
        if foreach is not None and not isinstance(foreach, bool):
            raise TypeError(f"foreach must be None, True or False, got {foreach!r}")
        with_grads = [p for p in self._all_params() if p.grad is not None]
        return self._step.clip_grad_norm_(with_grads, max_norm, norm_type, error_if_nonfinite,
                                          foreach)

    def reload_master_weights(self) -> None:
        """With ``shard=True`` and 16-bit parameters: take this rank's fp32
        master copies from the parameters again, where they differ from the
        masters rounded.

        ``step()`` does this by itself for parameters changed in place since
        the last step (``model.load_state_dict``, ``p.copy_`` under
        ``no_grad``: their version counter moved). A write through ``.data``
        moves no counter: call this after one. Without sharding, or without
        16-bit parameters, there are no masters and nothing happens.

        Examples:
            >>> model.weight.data.mul_(0.5); opt.reload_master_weights()   # doctest: +SKIP
        """
        self._step.reload_master_weights()

    def step(self, closure=None):
        """Run the wrapped optimizer's step on the reduced gradients.

        As ``torch.optim.Optimizer.step``: an optional ``closure`` re-evaluates
        the model (forward and ``backward()``) and returns the loss; it is
        called with grad enabled before the step (by the wrapped optimizer,
        as often as it calls it: once for SGD or Adam, several times for
        LBFGS), its backward reduces the gradients, and its loss is returned.
        With ``backward_passes_per_step=k`` the closure's backward is the k-th
        pass (the others ran before ``step``), as Lightning's gradient
        accumulation does it.

        Parameters frozen or unfrozen since the last step are followed
        first: the gradients a newly unfrozen parameter got in this step's
        backward (which ran before the optimizer knew) are reduced here, and
        from the next backward on the hooks cover exactly the trainable
        parameters; a frozen parameter without gradient keeps none.

        One call is not a training step: ``torch.distributed.checkpoint``'s
        ``get_state_dict``/``set_state_dict`` (and their optimizer-only
        forms) make the state where ``optimizer.state`` is empty by
        assigning zero gradients, setting every group's ``lr`` to 0 and
        calling ``step()``, on those ranks only. A step with no state on
        this rank, at learning rate 0, with every gradient all zeros and
        none reduced by a backward, is that call: it makes the state as
        ``init_state()`` does (locally: nothing communicated, nothing moved,
        not counted as a step).

        Raises:
            RuntimeError: the gradients were not reduced: ``step()`` (or the
                closure's backward) came after a backward pass that only
                accumulated (``backward_passes_per_step`` > 1, or ``no_sync()``);
                or parameters were frozen or unfrozen between the backward
                passes of one step; ``bcast_period`` > 0 during CUDA graph
                capture (see docs/guides/cuda-graphs.md); a finite
                ``max_grad_norm`` without ``loss_scale``, stepped by an
                enabled ``GradScaler`` whose scale is not 1 (checked at the
                first step: the gradients were clipped while scaled, so the
                limit applied to the scaled norm); nothing is stepped.

        Examples:
            >>> def closure():                                   # doctest: +SKIP
            ...     opt.zero_grad(); loss = loss_fn(model(x), y); loss.backward(); return loss
            >>> loss = opt.step(closure)                          # doctest: +SKIP
        """
        syncs_buffers = self.bcast_period != -1 and self._buffer_sync.communicates
        step_checks.refuse_before_step(self, syncs_buffers)
        step_checks.check_reduced_once(self)
        self._follow_requires_grad()
        if closure is None and checkpoints.is_checkpoint_initialisation(self, self.reducer):
            checkpoints.initialise_state(self, self._step, super())
            return None
        loss = self._step.step(self, super(), closure,
                               functools.partial(step_checks.check_reduced, self))
        if self.shard and self._step.skipped:
            return loss  # a GradScaler's skip inside Join: as if never called
        self.reducer.consume()
        self._steps += 1
        if uneven_inputs.in_join(self):
            return loss  # the broadcasts wait for the join's end (uneven_inputs)
        if self.bcast_period > 0 and self._steps % self.bcast_period == 0:
            self.broadcast_parameters()
        if syncs_buffers:
            self._buffer_sync()
        return loss

    def _shadow_step(self) -> None:
        """The step of a sharded rank that ran out of data (``Join``): its
        part stepped on the gradients its shadow pass reduced, and gathered."""
        self._step.step(self, super(), None, lambda: None, shadow=True)
        if not self._step.skipped:
            self._steps += 1

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``torch.optim.Optimizer.zero_grad``; reduced gradients that no step
        took (a step a GradScaler skipped) are discarded with it, so the next
        backward starts a new accumulation."""
        super().zero_grad(set_to_none)
        self.reducer.consume()

    def no_sync(self):
        """A context in which backward passes accumulate gradients locally."""
        return self.reducer.no_sync()
