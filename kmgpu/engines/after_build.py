"""What was done to a model after it was built that its config does not say, done
again to a replica built from that config.

- LoRA: ``layer.enable_lora(rank)`` (Keras's ``Dense``, ``EinsumDense``, ``Embedding``
  and convolutions; keras-hub's ``backbone.enable_lora(rank)`` calls it on the attention
  projections) adds ``lora_kernel_a`` / ``lora_kernel_b`` to a built layer and freezes its
  kernel. A layer built by its parent (the projections inside ``MultiHeadAttention``) is
  made again without them, so the replica has fewer variables than the model.
- Which layers and variables train: ``layer.trainable = False`` on a layer its parent
  builds, or ``variable.trainable = False``, is in no config.

``state`` reads them from the user's model as plain data (it travels to torch's
workers inside ``replication.carried``); ``replay`` applies them to a replica before its
weights are copied in.
"""


def state(model):
    """The after-build state of ``model``, picklable: the LoRA layers (their index in
    ``_flatten_layers``, rank, alpha), every layer's ``trainable``, and every weight's
    ``trainable``, path and shape."""
    layers = list(model._flatten_layers(include_self=True))
    lora = tuple((i, layer.lora_rank, getattr(layer, "lora_alpha", None))
                 for i, layer in enumerate(layers) if getattr(layer, "lora_enabled", False))
    return {"name": model.name, "lora": lora,
            "layers": tuple(layer.trainable for layer in layers),
            "weights": tuple(v.trainable for v in model.weights),
            "shapes": tuple((v.path, tuple(v.shape)) for v in model.weights)}


def replay(replica, saved):
    """Give ``replica`` (built from the model's config) the model's ``state``: LoRA where
    the model has it and the replica not, then the model's trainable flags, layers top
    down (a layer's flag sets its sublayers', which come after it).

    Raises:
        ValueError: the replica's weights still differ from the model's (a variable
            added after build otherwise), naming the first that differ.
    """
    if saved is None:
        return
    layers = list(replica._flatten_layers(include_self=True))
    if len(layers) != len(saved["layers"]):
        return _check(replica, saved)
    for index, rank, alpha in saved["lora"]:
        layer = layers[index]
        if not getattr(layer, "lora_enabled", True):
            layer.enable_lora(rank, lora_alpha=alpha)
    for layer, trainable in zip(layers, saved["layers"]):
        if layer.trainable != trainable:
            layer.trainable = trainable
    weights = replica.weights
    if len(weights) == len(saved["weights"]):
        for variable, trainable in zip(weights, saved["weights"]):
            if variable.trainable != trainable:
                variable.trainable = trainable
    _check(replica, saved)


def _check(replica, saved):
    theirs = saved["shapes"]
    ours = tuple((v.path, tuple(v.shape)) for v in replica.weights)
    if [shape for _, shape in theirs] == [shape for _, shape in ours]:
        return  # paths may differ: a subclass's unnamed layers are numbered anew
    first = next((i for i, (a, b) in enumerate(zip(theirs, ours)) if a[1] != b[1]),
                 min(len(theirs), len(ours)))

    def name(side):
        return f"{side[first][0]} {side[first][1]}" if first < len(side) else "nothing"

    model = saved["name"]
    raise ValueError(
        f"kmgpu: {model} has {len(theirs)} weights, its replica made from its config "
        f"{len(ours)}; the first that differ: {name(theirs)} in {model}, {name(ours)} in "
        "the replica. kmgpu makes each replica from the model's config, then does again "
        "what Keras can be asked after build (enable_lora, trainable flags); a variable "
        "added otherwise after build is in no config: create it in the layer's build() "
        "(or say it in get_config), then wrap the model.")
