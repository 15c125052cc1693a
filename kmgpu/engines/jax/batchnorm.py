"""Local BatchNormalization inside one SPMD program: each replica's own moments.

Under ``keras.distribution.DataParallel`` the model is one program over the global
batch, sharded along its first axis, and a BatchNormalization computes its moments
over all of it: XLA inserts a cross-device all-reduce in the forward pass and
another in the backward pass of every BN layer, one after the other on the
critical path (ResNet-50 at 64x64 on 2 GPUs: slower than one GPU).

``normalize`` computes what each device would compute on its own rows (torch DDP's
and MirroredStrategy's default): the batch ``(B, ...)`` is viewed as
``(N, B/N, ...)`` with axis 0 pinned to the mesh's batch axis, the moments are
taken over each replica's block, and the result is reshaped back. Replica r's
block is rows r*B/N ... (r+1)*B/N - 1, exactly the rows its data shard holds, so
XLA computes the moments, the normalisation and their gradients where the rows
are: no collective. The moving statistics are updated with the mean over replicas
of the per-replica moments, i.e. the mean of the N per-replica updates (as kmgpu's
torch engine averages them): an all-reduce of 2 x C floats per layer that nothing
in the step waits for until the step's end (XLA schedules it beside the gradient
all-reduces).

The arithmetic is Keras 3.15.1's own (``BatchNormalization.call`` with the JAX
backend's ``moments`` / ``batch_normalization``), so on each block it equals
BatchNormalization applied to those rows to float32 rounding.
"""


def normalize(layer, inputs, mask, mesh, batch_axis):
    """Training-mode output of BatchNormalization ``layer`` with per-replica moments.

    Args:
        layer: a built ``keras.layers.BatchNormalization`` (renorm off).
        inputs: the layer's input, first axis the batch, divisible by the mesh's
            size along ``batch_axis``.
        mask: None, or a mask of ``inputs.shape[:-1]`` (Keras's masked moments).
        mesh: the ``jax.sharding.Mesh`` of the distribution.
        batch_axis: the mesh axis the batch is sharded along.

    Returns:
        (outputs, mean, variance): outputs in the layer's compute dtype; mean and
        variance of shape (C,): the mean over replicas of each replica's moments.
    """
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    from keras import backend, ops

    n = mesh.shape[batch_axis]
    rank = len(inputs.shape)
    axis = layer.axis % rank
    compute_dtype = backend.result_type(inputs.dtype, "float32")
    x = ops.cast(inputs, compute_dtype)
    shape = tuple(x.shape)
    blocks = jnp.reshape(x, (n, shape[0] // n) + shape[1:])
    pin = NamedSharding(mesh, PartitionSpec(batch_axis))
    blocks = jax.lax.with_sharding_constraint(blocks, pin)
    channel = axis + 1
    reduce = tuple(i for i in range(1, rank + 1) if i != channel)
    if mask is None:
        mean = jnp.mean(blocks, reduce, keepdims=True)
        variance = jnp.var(blocks, axis=reduce, keepdims=True)
    else:  # Keras's masked moments (mask over all axes but the last), per block
        m = jnp.reshape(jnp.asarray(mask), (n, shape[0] // n) + tuple(mask.shape[1:]))
        m = jax.lax.with_sharding_constraint(m, pin)
        m = jnp.broadcast_to(jnp.expand_dims(m, -1), blocks.shape).astype("bool")
        weight = jnp.sum(m.astype(blocks.dtype), reduce, keepdims=True)
        mean = (jnp.sum(jnp.where(m, blocks, 0), reduce, keepdims=True)
                / (weight + backend.epsilon()))
        spread = jnp.sum(jnp.square(jnp.where(m, blocks - mean, 0)), reduce, keepdims=True)
        variance = spread / (weight + backend.epsilon())
    # ops.batch_normalization on JAX, with (N, 1, .., C, .., 1) moments
    inv = jax.lax.rsqrt(variance + layer.epsilon)
    channels = [1] * (rank + 1)
    channels[channel] = shape[axis]
    if layer.scale:
        inv = inv * jnp.reshape(ops.cast(layer.gamma, compute_dtype), channels)
    offset = -mean * inv
    if layer.center:
        offset = offset + jnp.reshape(ops.cast(layer.beta, compute_dtype), channels)
    outputs = jnp.reshape(jnp.add(blocks * inv, offset), shape)
    with jax.named_scope("kmgpu_replica_mean"):  # the one collective: moving statistics
        mean = jnp.reshape(jnp.mean(mean, axis=0), (shape[axis],))
        variance = jnp.reshape(jnp.mean(variance, axis=0), (shape[axis],))
    return ops.cast(outputs, layer.compute_dtype), mean, variance


def update_moving(layer, mean, variance):
    """``BatchNormalization``'s momentum update, with the replica-mean moments."""
    from keras import ops

    m = layer.momentum
    layer.moving_mean.assign(ops.cast(layer.moving_mean, mean.dtype) * m + mean * (1.0 - m))
    layer.moving_variance.assign(
        ops.cast(layer.moving_variance, variance.dtype) * m + variance * (1.0 - m))
