"""What ``describe()`` says of a sharded torch step: the bytes each rank keeps of the
weights, the gradients and the optimizer state (from the layout ``zero.Shards`` makes:
each variable 256-byte aligned, each flat buffer padded to N equal pieces; one buffer per
dtype, or with shard="weights" per layer and dtype), and the step in words."""

from kmgpu.engines.torch.optim import flat_layout, flat_optim


def _piece_bytes(variables, world, by_layer):
    """Bytes of one rank's piece of every flat buffer ``variables`` make."""
    groups = flat_layout.layer_groups(variables) if by_layer else [None] * len(variables)
    buffers = {}
    for g, v in zip(groups, variables):
        buffers.setdefault((g, v.value.dtype), []).append(v.value)
    return sum(flat_layout.offsets(ts, world)[1] // world * ts[0].element_size()
               for ts in buffers.values())


def _whole(variables):
    return sum(v.value.numel() * v.value.element_size() for v in variables)


def state_bytes(template, world, by_layer=False):
    """(optimizer-state bytes on each of ``world`` ranks, whole bytes, bytes kept whole
    on every rank: the step count and other scalars); None when the optimizer is not
    built or not shardable."""
    from kmgpu.engines import replication

    opt = getattr(template, "optimizer", None)
    if opt is None or not opt.built:
        return None
    inner = flat_optim.scaler(opt)[1]
    if not flat_optim.supported(inner, template.trainable_weights)[0]:
        return None
    whole = _whole(replication.optimizer_state(opt))
    slots = [s for s in flat_optim.SLOTS[flat_optim.kind(inner)] if s[2] is None or s[2](inner)]
    if flat_optim.EMA[2](inner):
        slots.append(flat_optim.EMA)
    trainable = template.trainable_weights
    kept = whole - _whole(trainable) * len(slots)
    return kept + len(slots) * _piece_bytes(trainable, world, by_layer), whole, kept


def grad_bytes(template, world, by_layer=False):
    """(gradient bytes each rank keeps between steps with shard="gradients" / "weights":
    its pieces, whole bytes, 0); within a step shard="gradients" makes the whole buffers,
    shard="weights" one layer's at a time, reduce-scattered as the backward pass makes
    it (with clipnorm / global_clipnorm / mixed_float16 both make the whole buffers,
    all-reduced whole, and no piece is kept at all)."""
    trainable = template.trainable_weights
    if not trainable:
        return None
    return _piece_bytes(trainable, world, by_layer), _whole(trainable), 0


def weight_bytes(template, world):
    """(weight bytes each rank keeps between steps with shard="weights": its pieces of
    the layers' trainable buffers and every non-trainable variable whole, whole bytes,
    the non-trainable bytes); within a step the gathered layers come on top."""
    trainable = template.trainable_weights
    if not trainable:
        return None
    ids = {id(v) for v in trainable}
    kept = _whole([v for v in template.weights if id(v) not in ids])
    return kept + _piece_bytes(trainable, world, True), kept + _whole(trainable), kept


STAGES = {"optimizer": "ZeRO-1",
          "gradients": "ZeRO-2: the whole gradient freed once reduce-scattered",
          "weights": "ZeRO-3: each layer's weights gathered where forward and backward use "
                     "them, freed after; each layer's gradient reduce-scattered as "
                     "backward makes it (all-reduced whole where clipping or a loss scale "
                     "needs it)"}


def describe(text, world, template, shard="optimizer"):
    """``graphs.describe``'s words for ``template``'s step, made to say what a sharded
    step does."""
    gather = "" if shard == "weights" else "all-gather of the weights, "
    what = (f"forward+backward into a flat gradient buffer, reduce-scatter (all-reduce with "
            f"clipnorm/global_clipnorm/mixed_float16), the optimizer on this rank's 1/{world} "
            f"of the state ({STAGES[shard]}), {gather}metrics")
    if text.startswith("Keras's eager step"):  # a CPU: the split step runs eagerly
        return f"split step ({what}), eager: CUDA graphs need GPUs"
    unsharded = ("forward+backward into a flat gradient buffer, one all-reduce, optimizer "
                 f"({flat_optim.optimizer_words(template)})+metrics")
    return text.replace(unsharded, what)
