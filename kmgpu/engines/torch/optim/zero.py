"""``shard="optimizer"`` (``shard_optimizer=True``, ZeRO-1), ``"gradients"`` (ZeRO-2) and
``"weights"`` (ZeRO-3 / FSDP) on torch: the flat optimizer on a piece.

The split step (``split_step``) keeps the gradient in one flat buffer per dtype
(``flat_layout.Buffers``), its head padded to N equal, 256-byte aligned pieces, laid out
as the weights; rank r owns the contiguous piece r of each. Per step:

  A  forward/backward into the flat gradient buffers (as unsharded);
     ``exchange``: a reduce-scatter of each buffer (``torch.distributed.reduce_scatter_single``,
     NCCL and gloo both have it), so each rank gets the summed gradient of its piece only;
     with ``clipnorm`` / ``global_clipnorm`` an all-reduce instead (the norms need every
     element; the rank then reads its piece, a view); BatchNorm statistics all-reduced;
  B  ``update``: the unsharded update (``flat_optim.FlatOptimizer.update``) on this rank's
     piece of the weights with this rank's piece of the optimizer state: the only state
     allocated while training (Adam: 8/N bytes per parameter instead of 8);
     ``gather``: an all-gather of the updated pieces into the whole flat weights, in place,
     then Keras's variable constraints on the whole weights.

The exchange and the gather stay outside the CUDA graphs (as the unsharded all-reduce);
B's update is captured (shard="weights": the layers' reduce-scatters are inside graph A,
below). The Keras optimizer's own slot variables hold no memory while a fit trains (an
empty tensor); ``materialize`` gathers the state into them on rank 0 (a
collective at the same moment on every rank: at fit's validation, every epoch end, the
end of training, after ``train_on_batch`` and when a fit stops early; the other ranks
keep 1/N; under torchrun every process's own model gets it: all-gather), so the user's
model gets the whole optimizer state back, ``save`` / ``load_model`` work as unsharded,
and a later call's state (loaded, or broadcast from rank 0) is taken back into the pieces
at the next step (``release``).

``use_ema``: ``materialize`` all-gathers the moving averages to every rank (the other
slots still go to rank 0 only). Keras's fit ends with ``finalize_variable_values`` on
every rank, after the last epoch end's gather: each weight is assigned its whole average,
so every rank's replica ends with rank 0's weights (the replicas stay resident for the
next call). The all-gather moves what the gather moves into rank 0; the whole
averages are freed again at the next step.

shard="gradients" (``transient``): the same step, but the split step makes its whole
gradient buffers anew for each step and lets go of them once reduce-scattered (a captured
graph A makes its own inside the capture, in its memory pool, as its activations), so
between steps a rank keeps the whole weights, its 1/N of the gradient and its 1/N of the
optimizer state: 4 + (4 + 8)/N bytes per parameter with Adam in float32.

shard="weights" (``weights``, ``fsdp``): one flat buffer per layer and dtype, each cut
into N pieces; a rank keeps its pieces of the weights as tensors of their own, the whole
buffers are freed and gathered layer by layer where the forward and the backward read
them (``active``); no all-gather after the update. The step makes no whole gradient
buffer: each layer's gradient is reduce-scattered into this rank's piece within the
backward pass as soon as it is complete, from a buffer as long as that layer's (two
taking turns), autograd's gradients freed at once (``by_layer``, ``scattered``,
``scattering.Scattering``); ``exchange`` then has only the statistics to all-reduce. With
clipnorm / global_clipnorm / mixed_float16 the whole gradient is all-reduced after the
backward pass instead (as above). About 16/N bytes per parameter, plus within a step
the gathered layers (``fsdp.KEEP`` and ``fsdp.PREFETCH`` ahead), two layers' gradient
buffers (the whole gradient buffers where it is all-reduced whole) and the activations.
Variable constraints and ``use_ema`` are refused (``check``): both need every weight
whole after each update. The replica's variables may be in host memory when the
``Shards`` are made (``device``; ``placement``): only the pieces are copied to the
device. In a pool, each rank copies its pieces of a call's state straight from the
state file and writes them into its snapshots (``piece_state``): no rank reads, gathers
or holds the whole weights or optimizer state, on its device or in host memory. Under
torchrun a call's state is loaded into host buffers (``receivable``) and rank 0's is
sent piece by piece (``take``).

``materialize`` puts a whole copy for the user's model in host memory: shard="optimizer"
and "gradients" rank 0's (``fsdp.to_host``), which a pool worker lets go of once written
out (``DDPStrategy.let_go``); under torchrun every rank's (shard="weights": one layer at a
time through the device). No rank keeps a whole copy on its device.

Only elementwise updates can be cut into pieces: Keras's SGD, Adam, AdamW, RMSprop,
Adagrad, Lion, Nadam and Adamax with their options (``flat_optim.COVERED``); anything else
(Adafactor's factored moments, Lamb's per-layer trust ratio, Muon, a subclass, gradient
accumulation) is refused by ``check`` before any work. ``mixed_float16``'s
LossScaleOptimizer around one of them is sharded: its finite check needs the whole
gradient, so the gradient is all-reduced, not reduce-scattered.
"""

import contextlib

import keras
import torch
import torch.distributed as dist

from kmgpu.engines.torch.optim import flat_layout, flat_optim, fsdp, scattering, unfilled

EMA = flat_optim.EMA[0]  # the moving averages' slot (``use_ema``)


def check(optimizer, shard="optimizer", variables=()):
    """Raise ValueError (what to do instead) when ``optimizer`` cannot be sharded (with
    shard="weights" also: ``variables``, the trainable ones, with a constraint, or
    ``use_ema``: both need the whole weights after each update)."""
    if optimizer is None:
        return
    if shard == "weights":
        inner = flat_optim.scaler(optimizer)[1]
        bound = [v.path for v in variables if v.constraint is not None]
        if bound or getattr(inner, "use_ema", False):
            what = f"variables with a constraint ({bound})" if bound else "use_ema"
            raise ValueError(
                f"shard='weights' on torch keeps 1/N of the weights on each rank; {what} "
                "needs every weight whole after each update. Pass shard='gradients' (the "
                "weights whole, the gradient and optimizer state 1/N), or the JAX backend.")
    ok, why = flat_optim.supported(optimizer)
    if not ok:
        name = type(optimizer).__name__
        asked, off = (("shard_optimizer=True", "shard_optimizer=False") if shard == "optimizer"
                      else (f"shard={shard!r}", "shard=None"))
        raise ValueError(
            f"{asked} on torch shards an update that is elementwise over the "
            f"parameters: Keras's {', '.join(flat_optim.COVERED)}; this optimizer is not ({why}"
            f"). Use one of those, pass {off}, or the JAX backend "
            f"(KERAS_BACKEND=jax), which shards any optimizer's state. ({name})")


class Shards:
    """This rank's piece of the optimizer (see the module): ``flat``, the flat optimizer
    on piece ``rank`` of ``world``, and the collectives around its update.

    Args:
        optimizer: the Keras optimizer (built here if needed, as Keras's apply does).
        trainable: the trainable variables, the step's order.
        rank, world: this rank and the number of ranks.
        transient: the step makes its whole gradient buffers anew each step (ZeRO-2,
            ``split_step``): ``grad_buffers`` comes at every step, ``drop_grads`` after.
        weights: the weights sharded too (ZeRO-3, ``fsdp``): one flat buffer per layer
            and dtype, this rank's pieces of them its own tensors, the whole buffers
            freed except where ``gathering`` makes them whole; the gradient
            reduce-scattered layer by layer within the backward pass (``scattered``)
            unless it is all-reduced whole.
        device: the rank's device (None: the variables'). With ``weights`` the
            variables may still be in host memory (the replica built there): only the
            pieces are copied to ``device``, and the variables become views of buffers
            on it that are freed as soon as made (``Buffers.move_freed``). Variables made
            without memory (``unfilled``) are laid out unread, their pieces zeros until a
            call's state fills them.
    """

    def __init__(self, optimizer, trainable, rank, world, transient=False, weights=False,
                 device=None):
        check(optimizer)
        self.rank, self.world, self.transient = rank, world, transient
        self.weights = weights
        if weights:
            bound = [v.path for v in trainable if v.constraint is not None]
            if bound:
                raise ValueError(
                    f"shard='weights' on torch: variables with a constraint ({bound}) need "
                    "their whole value after each update; pass shard='gradients'.")
        # the weights become views of flat buffers padded to ``world`` equal aligned
        # pieces; the state of this rank's piece is taken from the Keras slots below
        # made without memory (``unfilled``): nothing to read, a call's state follows
        empty = weights and any(unfilled.is_unfilled(v) for v in trainable)
        self.flat = flat_optim.FlatOptimizer(optimizer, trainable, rank, world,
                                             groups=flat_layout.layer_groups(trainable) if weights else None,
                                             device=device, unfilled=empty)
        self.gathering = None
        self.weights_whole = False  # the whole weights are in the Keras variables (host)
        self._host = None  # shard="weights": host buffers a call's state is loaded into
        if weights:
            self.flat.own_pieces()  # onto the device, from wherever the weights are
            if empty or self.flat.params[0].device != self.flat.device:  # built in host memory
                self.flat.weights.move_freed(self.flat.device)
            else:
                for f in self.flat.params:
                    fsdp.free(f)
            # the variables' views of the (freed) flat buffers, kept to put back after a
            # host copy (a view of a freed buffer cannot be made, only kept)
            self._device_views = [p.data for p in self.flat.weights.views]
            self.gathering = fsdp.Gathering(self.flat.params,
                                            [p.params for p in self.flat.pieces],
                                            variables=self.flat.variables)
        opt = self.flat.optimizer
        # the whole gradient on every rank (all-reduce): the clipping norms, and the
        # loss scale's finite check, need every element
        self.whole = bool(opt.clipnorm or opt.global_clipnorm or self.flat.scaler)
        #: shard="weights", the gradient not all-reduced whole: each layer's gradient is
        #: reduce-scattered within the backward pass (``scattered``), not by ``exchange``
        self.by_layer = weights and not self.whole
        self.scattering = None  # the ``scattering.Scattering`` (made at the first backward)
        self.materialized = True  # the Keras slot variables hold the state now
        # of the Keras slot variables, only the moving averages' are whole (``materialize``
        # off rank 0 with ``use_ema``)
        self.ema_held = False
        self.stepped = False  # a step ran since the last materialize (every rank alike)
        self.grad_flats = self.grad_pieces = None
        if empty:  # the slots hold nothing to take either
            self.drop_slots()
        self.release()

    def grad_buffers(self, flats):
        """Use ``flats``, the step's flat gradient buffers (laid out as the weights), and
        make this rank's gradient pieces of them: views where the gradient is
        all-reduced whole, else tensors of their own, made once (a captured update
        reads them at the same address whichever step's buffers are in use)."""
        self.grad_flats = list(flats)
        if self.whole:  # all-reduced whole: the piece is a view
            self.grad_pieces = [f[p.lo:p.hi] for f, p in zip(flats, self.flat.pieces)]
        elif self.grad_pieces is None:
            self.grad_pieces = [f.new_zeros(p.hi - p.lo) for f, p in zip(flats, self.flat.pieces)]

    def drop_grads(self):
        """Let go of the step's whole gradient buffers (``transient``): only this rank's
        own pieces stay (none where the gradient is all-reduced whole)."""
        self.grad_flats = None
        if self.whole:
            self.grad_pieces = None

    # -- one step -----------------------------------------------------------------------
    @contextlib.contextmanager
    def scattered(self):
        """``by_layer``: within the block a backward pass reduce-scatters each layer's
        gradient into this rank's piece as soon as it is complete, autograd's gradients
        freed at once (``scattering.Scattering``; the pieces are made once, so a
        captured update reads them at the same address). Otherwise
        nothing: ``exchange`` reduces the step's whole buffers."""
        if not self.by_layer:
            yield
            return
        if self.scattering is None:
            self.scattering = scattering.Scattering(self.flat.weights, self.grad_pieces)
        with self.scattering.active([v.value for v in self.flat.variables]):
            yield

    def exchange(self):
        """The summed gradient of this rank's piece (eager: outside any graph; with
        ``by_layer`` the backward pass did it already)."""
        if self.by_layer:
            return
        for flat, piece in zip(self.grad_flats, self.grad_pieces):
            if self.whole:
                dist.all_reduce(flat)
            else:
                fsdp.reduce_scatter(piece, flat)

    def update(self):
        """The flat optimizer's update of this rank's piece (capturable)."""
        self.flat.update(self.grad_pieces, self.grad_flats if self.whole else None)

    @contextlib.contextmanager
    def active(self, key="train"):
        """shard="weights": within the block the layers' weights are gathered where used
        and freed after (``fsdp.Gathering``, prefetching in the order the last block of
        ``key`` used them); afterwards none is whole (every rank)."""
        if self.gathering is None:
            yield
            return
        self.free_weights()  # rank 0's host copy for the user's model: the device views back
        try:
            with self.gathering.active(key):
                yield
        finally:
            self.weights_whole = False

    @torch.no_grad()
    def gather(self):
        """Every rank's updated piece into the whole weights (in place, eager), then
        Keras's variable constraints (shard="weights": nothing, the pieces are the
        weights)."""
        self.stepped = True
        if self.weights:
            return
        for flat, piece in zip(self.flat.params, self.flat.pieces):
            fsdp.all_gather(flat, piece.params)
        self.flat.constrain()

    # -- the Keras optimizer's variables ------------------------------------------------
    def _keras_views(self, k, name, whole):
        """Make the Keras slot variables ``name`` of weights buffer ``k``'s variables views
        of ``whole`` (a buffer laid out as it)."""
        variables = self.flat.keras_slots[name]
        for i, view in zip(self.flat.weights.members[k], self.flat.weights.split(k, whole)):
            variables[i].value.data = view

    @torch.no_grad()
    def materialize(self, everywhere=False):
        """Gather the optimizer state into the Keras slot variables (a collective: every
        rank, at the same point): on rank 0 only (what snapshots the state for the user's
        model; the other ranks keep 1/N), or on every rank (``everywhere``: each process
        has its own user model, torchrun). ``use_ema``'s moving averages go to every rank
        (all-gather): fit's ``finalize_variable_values`` reads them whole on every rank.
        Rank 0's whole state is put in host memory (one piece at a time through the
        device: ``fsdp.to_host``), so no rank holds a whole copy of it on its device. No-op
        where they hold it already."""
        mine = everywhere or self.rank == 0
        host = not everywhere
        if self.weights and not self.weights_whole:  # (the same on every rank)
            for k, (flat, piece) in enumerate(zip(self.flat.params, self.flat.pieces)):
                if everywhere:  # one layer whole on the device at a time, then host
                    fsdp.grow(flat)
                    fsdp.all_gather(flat, piece.params)
                    whole = flat.to(fsdp.HOST, copy=True)
                    fsdp.free(flat)
                else:  # rank 0: host memory
                    whole = fsdp.to_host(piece.params, flat.numel(), self.rank, self.world)
                if whole is not None:  # the variables, views of it until ``free_weights``
                    self._host_views(k, whole)
            self.weights_whole = True
        if not self.stepped:  # nothing new since the last gather: the same on every rank
            return
        self.stepped = False
        for k, (flat, piece) in enumerate(zip(self.flat.params, self.flat.pieces)):
            for name, own in piece.slots.items():
                here = mine or name == EMA
                if host and name != EMA:
                    whole = fsdp.to_host(own, flat.numel(), self.rank, self.world)
                elif everywhere or name == EMA:
                    whole = own.new_empty(flat.numel())
                    fsdp.all_gather(whole, own)
                    if self.weights:  # host memory (shard="weights": no EMA)
                        whole = whole.to(fsdp.HOST, copy=True)
                else:
                    whole = own.new_empty(flat.numel()) if here else None
                    dist.gather(own, list(whole.chunk(self.world)) if mine else None, dst=0)
                if here:
                    self._keras_views(k, name, whole)
        self.materialized = mine
        self.ema_held = not mine and EMA in self.flat.keras_slots

    def _host_views(self, k, whole):
        """Weights buffer ``k``'s variables become views of ``whole``, a host buffer laid
        out as it (until ``free_weights``)."""
        weights = self.flat.weights
        for i, view in zip(weights.members[k], weights.split(k, whole)):
            weights.views[i].data = view

    @torch.no_grad()
    def receivable(self):
        """Before a call's state is loaded into the Keras variables (a call's start, or
        the driver's callbacks changed the model): the Keras slot variables made whole
        again where they are not; shard="weights": the weights and the slots in host
        memory (one zeroed host buffer per layer: a rank's device never holds them
        whole), which ``take`` cuts into this rank's pieces. Without ``weights`` the
        next step takes the pieces of the slots (``release``)."""
        if self.weights and self._host is None:
            self.free_weights()
            self._host = [torch.zeros(f.numel(), dtype=f.dtype, device=fsdp.HOST)
                          for f in self.flat.params]
            for k, whole in enumerate(self._host):
                self._host_views(k, whole)
            self.weights_whole = True
        if self.materialized:
            return
        self.ema_held = False  # replaced below: every slot is received whole
        for k, flat in enumerate(self.flat.params):
            for name in self.flat.keras_slots:
                whole = (torch.zeros(flat.numel(), dtype=flat.dtype, device=fsdp.HOST)
                         if self.weights else flat.new_zeros(flat.numel()))
                self._keras_views(k, name, whole)
        self.materialized = True

    @torch.no_grad()
    def take(self, scatter=False):
        """shard="weights", after the state was loaded into the host buffers
        (``receivable``): this rank's pieces of the weights and of the optimizer state
        from them, then the host buffers let go. ``scatter``: the ranks loaded different
        states and rank 0's wins: it sends each rank its pieces (point to point, one
        piece at a time through the device: NCCL and gloo both), no rank gets the
        whole."""
        if not self.weights or self._host is None:
            return
        weights = self.flat.weights
        for k, piece in enumerate(self.flat.pieces):
            pairs = [(piece.params, self._host[k])]
            for name, own in piece.slots.items():
                whole = torch.zeros_like(self._host[k])
                for v, view in zip([self.flat.keras_slots[name][i] for i in weights.members[k]],
                                   weights.split(k, whole)):
                    view.copy_(v.value)
                pairs.append((own, whole))
            for own, whole in pairs:
                if scatter:
                    fsdp.from_rank0(own, whole, self.rank, self.world)
                else:
                    own.copy_(whole[piece.lo:piece.hi])
        self._host = None
        self.free_weights()
        for variables in self.flat.keras_slots.values():
            for var in variables:
                var.value.data = var.value.new_empty(0)
        self.materialized = False

    def drop_slots(self):
        """The Keras slot variables hold no memory (their state is in the pieces)."""
        for variables in self.flat.keras_slots.values():
            for var in variables:
                var.value.data = var.value.new_empty(0)
        self.materialized = False

    def free_weights(self):
        """shard="weights": the whole weights freed (the pieces are current): the
        variables views of the freed flat buffers again where ``materialize`` made them
        views of a host copy."""
        if not self.weights:
            return
        self._host = None
        for flat in self.flat.params:
            fsdp.free(flat)
        for param, view in zip(self.flat.weights.views, self._device_views):
            if fsdp.storage_key(param) != fsdp.storage_key(view):
                param.data = view
        self.weights_whole = False

    @torch.no_grad()
    def release(self):
        """Take this rank's piece of the state from the Keras slot variables (they may
        have been loaded or broadcast since ``materialize``) and free their memory (where
        only the moving averages are whole, the pieces are current: those are freed);
        shard="weights": the whole weights a gather left are freed too."""
        self.free_weights()
        if self.ema_held:
            for var in self.flat.keras_slots[EMA]:
                var.value.data = var.value.new_empty(0)
            self.ema_held = False
        if not self.materialized:
            return
        weights = self.flat.weights
        for k, piece in enumerate(self.flat.pieces):
            for name, own in piece.slots.items():
                variables = self.flat.keras_slots[name]
                for i, a, b in weights.overlaps(k, piece.lo, piece.hi):
                    o = weights.start[i]
                    own[a - piece.lo:b - piece.lo].copy_(
                        variables[i].value.reshape(-1)[a - o:b - o])
        for variables in self.flat.keras_slots.values():
            for var in variables:
                var.value.data = var.value.new_empty(0)
        self.materialized = False

    def state_bytes(self):
        """(bytes of optimizer slots this rank holds while training, bytes unsharded)."""
        pieces = self.flat.pieces
        per = sum(s.numel() * s.element_size() for p in pieces for s in p.slots.values())
        whole = sum(f.numel() * f.element_size() * len(p.slots)
                    for f, p in zip(self.flat.params, pieces))
        return per, whole


class GatherOptimizerState(keras.callbacks.Callback):
    """In a sharded fit, on every rank: the whole optimizer state into rank 0's (or, with
    ``everywhere``, every rank's) Keras variables before fit's validation, at every epoch
    end and at the end of training (before rank 0 snapshots it), ``use_ema``'s moving
    averages into every rank's (before fit's ``finalize_variable_values``); the next step
    takes the pieces back."""

    def __init__(self, split, everywhere=False):
        super().__init__()
        self.split, self.everywhere = split, everywhere

    def _gather(self, *args, **kwargs):
        if self.split.zero is not None:
            self.split.zero.materialize(self.everywhere)

    on_test_begin = on_epoch_end = on_train_end = _gather

