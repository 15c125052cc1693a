"""JAX engine: ``keras.distribution.DataParallel`` over a 1-D ``jax.sharding`` mesh.

Variables are replicated, each batch is sharded along its first axis, and XLA's
SPMD partitioner inserts the gradient all-reduce.

BatchNormalization, ``sync_batchnorm=False`` (the default): each replica normalises
with the moments of its own rows, as torch DDP and MirroredStrategy do, with no
collective in the layer's forward or backward pass (``batchnorm.py``); the moving
statistics are updated with the mean over replicas of the per-replica moments (one
small all-reduce per layer that the step does not wait on). ``sync_batchnorm=True``:
Keras's own layer under SPMD computes the moments over the sharded global batch,
exactly as on one device, at the price of an all-reduce in the forward and one in
the backward pass of every BatchNormalization, one after the other on the critical
path (a network with many BatchNormalizations can then run slower on several GPUs than
on one).

Keras 3 raises ``IndivisibleError`` for a batch whose size the device count does
not divide. kmgpu places such a batch (the last partial one, or a batch smaller
than the device count) replicated on every device instead: each device computes
the whole batch, the step equals the one-device step, and no sample is dropped.
With local BatchNorm such a batch normalises with the moments of the whole batch
(every device holds all of it; still no collective).

``shard=`` lays the optimizer state ("optimizer"), and the gradients ("gradients"), and
the weights ("weights") out over the devices, 1/N on each (``zero.py``); the user's model
then keeps its whole state in host memory (``host.py``).

The train step is Keras's own jitted step, on one device (the user's own ``fit``) and
on several: a step that passes the model state as a few flat arrays gains on host-bound
models but its extra compile lengthens the first epoch and it loses on others, so
Keras's step is kept.
"""

import contextlib
import os

from kmgpu.engines import heap
from kmgpu.engines.base import InProcessEngine
from kmgpu.engines.jax import data_fixes, host, layer_fixes, optimizer_fixes, step_fixes, zero


class JaxEngine(InProcessEngine):
    name = "keras.distribution.DataParallel (jax.sharding)"
    shards = ("optimizer", "gradients", "weights")

    def __init__(self, config):
        super().__init__(config)
        import jax
        import keras

        devices = [jax.devices()[i] for i in config.device_ids]
        self.sharded = bool(config.shard) and len(devices) > 1  # zero.py, host.py
        if self.sharded and devices[0].platform == "cpu":
            # the devices' memory is this process's heap: the sharded state and a step's
            # layer-sized buffers go back to the system when freed, not kept there
            heap.map_large_blocks()
        if self.sharded and config.shard == "weights":
            self.distribution = zero.Distribution(devices)
        else:
            self.distribution = keras.distribution.DataParallel(devices=devices)
        from kmgpu.engines.jax import runtime

        self._template = None  # the template of the call in progress (host.py)
        self.multiprocess = runtime.multiprocess()  # kmgpu launch: jax.distributed
        if self.multiprocess:  # every process passes the same data; kmgpu places it
            self.distribution.auto_shard_dataset = False
            self.name += f", {jax.process_count()} processes (jax.distributed)"

    @classmethod
    def plain_fit_serves(cls, model, device_ids):
        # Keras's own JAX fit drops stateful RNN states: those need the engine.
        import jax

        from kmgpu.engines import replication

        return (list(device_ids) == [0] and jax.process_count() == 1
                and not replication.stateful_layers(model))

    def scope(self):
        return self.distribution.scope()

    def _ensure_replica(self, template, lr_scale):
        d = self.distribution
        replica = super()._ensure_replica(template, lr_scale)
        optimizer = getattr(replica, "optimizer", None)
        if self.config.shard_optimizer:  # before its optimizer makes a variable
            zero.shard(optimizer, d)
        if self.config.shard in ("gradients", "weights"):
            zero.shard_gradients(optimizer, d)
        # the replica's next step donates its variables: none may share an array
        optimizer_fixes.separate_ema_overwrite(optimizer)
        return replica

    def run(self, method, template, kwargs, lr_scale=(1.0, 0)):
        self._method = method  # copy_back: after a fit, the heap is trimmed first
        if self.sharded:  # the template's whole state stays off the accelerators
            host.to_host(host.template_variables(template))
            self._template = template
            if self.multiprocess and method == "fit":  # process 0 holds only pieces
                kwargs = dict(kwargs, callbacks=host.writers_read_template(
                    self, template, kwargs.get("callbacks")))
        return super().run(method, template, kwargs, lr_scale)

    def prepare_replica(self, replica, template):
        d = self.distribution
        self._bn = (0, [])
        if not self.config.sync_batchnorm and self.num_replicas > 1:
            self._bn = layer_fixes.local_batchnorm(replica, d)
        layer_fixes.track_states(replica, d)  # stateful RNNs: carried through the jit
        step_fixes.fresh_loss_ids(replica)  # a step's own losses, every trace
        layer_fixes.keep_remat(replica, template)  # keras.RematScope, as built
        if self.multiprocess:
            step_fixes.replicated_predictions(replica, d.device_mesh.backend_mesh)
        if (self.sharded and self.config.shard in ("gradients", "weights")
                and d.device_mesh.backend_mesh.devices.flat[0].platform == "cpu"):
            # the step holds one layer's whole weights and gradients at a time, not all
            flags = os.environ.get("XLA_FLAGS", "")
            step_fixes.compile_with(replica, step_fixes.cpu_options(flags))

    def same_values(self, pairs):
        """JAX arrays are immutable: a variable whose value is still the array it held
        when kmgpu last made the pair equal holds the same value. Other pairs are
        compared on the device (an evaluate or predict hands the replica new arrays of
        the same values)."""
        if self.multiprocess:  # arrays across processes: no cheap sound test, copy all
            return super().same_values(pairs)
        marks = getattr(self, "_marks", {})
        same, unsure = [], []
        for i, (t, r) in enumerate(pairs):
            if getattr(r, "_value", None) is None:  # emptied: copy it in
                same.append(False)
                continue
            mark = marks.get(id(t))
            same.append(mark is not None and mark[0] is t and mark[1] is r
                        and mark[2] is host.current(t) and mark[3] is r.value)
            if not same[-1]:
                unsure.append(i)
        if unsure and not self.sharded:  # sharded: no whole copy on a device to compare
            for i, ok in zip(unsure, _equal([pairs[i] for i in unsure])):
                same[i] = ok
        return same

    def copy_back(self, pairs):
        """The replicas' first copies to the template, on the device: a large array is
        written into the template's own buffer (``_into``: a donated copy, no new memory),
        the rest in one batched ``device_put`` (through NumPy it was ~1 s per fit for
        ResNet-50 + Adam on CPU). The template's former arrays are given up, as plain
        Keras's ``fit`` gives up a variable's former array (its step donates them).

        Sharded: the optimizer's sharded state is held, not gathered (``host.hold``), and
        the weights are gathered to the host a few at a time (``HOST_BATCH_BYTES``), each
        former array given up before the next batch: one whole copy of the weights, not
        two. After a fit the C heap's free pages go back to the system first
        (``heap.trim_heap``), so the gathered weights do not add to the step's freed
        buffers."""
        import jax

        # the marks hold the template's arrays of the copy-in: let each go as it is replaced
        # (``note_synced`` marks the new ones)
        self._marks = {}
        if self.multiprocess:  # arrays across processes: through NumPy, as before
            for r, t in pairs:
                value = zero.host_value(r.value)
                t.assign(jax.device_put(value, host.device()) if self.sharded else value)
            return
        if self.sharded:
            pairs = self._hold_optimizer_state(pairs)
            if getattr(self, "_method", None) == "fit":  # not per batch: pages fault back in
                # the step's buffers, freed into the heaps of the threads that ran them,
                # stay resident; the gathered weights come from another thread's heap
                heap.trim_heap()
        values = [zero.gather(r.value) for r, _ in pairs]
        into = _reusable([t.value for _, t in pairs], values)
        done = set(into)
        rest = [i for i in range(len(pairs)) if i not in done]
        if into:
            for i, v in zip(into, _into([pairs[i][1].value for i in into],
                                        [values[i] for i in into])):
                pairs[i][1].assign(v)
        if rest and self.sharded:
            for batch in _batches(rest, [values[i].nbytes for i in rest], HOST_BATCH_BYTES):
                copies = jax.device_put([values[i] for i in batch], host.device(),
                                        may_alias=False)
                for i, v in zip(batch, copies):
                    pairs[i][1].assign(v)
        elif rest:
            places = [pairs[i][1].value.sharding for i in rest]
            copies = jax.device_put([values[i] for i in rest], places, may_alias=False)
            for i, v in zip(rest, copies):
                pairs[i][1].assign(v)

    def _hold_optimizer_state(self, pairs):
        """``host.hold`` each of the template's optimizer variables whose replica value is
        sharded; the other pairs, to copy."""
        from kmgpu.engines import replication

        opt = getattr(self._template, "optimizer", None)
        mine = {id(v) for v in replication.optimizer_state(opt)} if opt is not None else set()
        rest = []
        for r, t in pairs:
            if (id(t) in mine and host.can_hold(t)
                    and not r.value.sharding.is_fully_replicated):
                host.hold(t, r, self.replica.jax_state_sync)
            else:
                rest.append((r, t))
        return rest

    def settle(self, replica):
        # Keras's JAX evaluate / predict take the variables' values out for the loop and
        # put them back only when it ends: a callback that raises leaves them empty
        # (fit does this in a finally). The last step's state is still at hand.
        replica.jax_state_sync()
        if self.sharded:  # the state copied back next goes to the host
            host.built_on_host(self._template, replica)

    def note_synced(self, pairs):
        self._marks = {id(t): (t, r, host.current(t), r.value) for t, r in pairs}

    def run_on_batch(self, replica, method, kwargs):
        if method == "predict_on_batch":  # Keras's own does not shard the batch
            kwargs = dict(kwargs, x=self._sharded(kwargs["x"]))
        return getattr(replica, method)(**kwargs)

    def _sharded(self, x):
        import jax
        import keras
        from jax.sharding import NamedSharding, PartitionSpec

        d = self.distribution
        if self.multiprocess:
            return x
        if any(a.shape[0] % self.num_replicas for a in keras.tree.flatten(x)):
            # replicated on every device, as fit places such a batch
            everywhere = NamedSharding(d.device_mesh.backend_mesh, PartitionSpec())
            return keras.tree.map_structure(lambda a: jax.device_put(a, everywhere), x)
        return keras.tree.map_structure(
            lambda a: keras.distribution.distribute_tensor(a, d.get_data_layout(a.shape)), x)

    @contextlib.contextmanager
    def call_context(self, method):
        with data_fixes.replicate_indivisible(self.distribution):
            yield

    def sharded_bytes(self, template, kind):
        d, shard = self.distribution, self.config.shard
        if kind == "weights":
            return zero.weight_bytes(self.replica, template, d, shard == "weights")
        if kind == "gradients":
            return zero.gradient_bytes(template, d, shard in ("gradients", "weights"))
        return zero.state_bytes(self.replica, template, d, self.config.shard_optimizer)

    def batchnorm_mode(self):
        if self.num_replicas == 1:
            return "one device"
        if self.config.sync_batchnorm:
            return ("global batch (sync_batchnorm=True: exact as one device; an all-reduce "
                    "in the forward and the backward pass of every BatchNormalization)")
        text = ("per replica (each device's own rows, no collective; moving statistics: "
                "mean over replicas, one small all-reduce per layer off the critical path)")
        kept = getattr(self, "_bn", (0, []))[1]
        if kept:  # known once the replica exists (the first call)
            names = ", ".join(kept[:3]) + (", ..." if len(kept) > 3 else "")
            text += (f"; global batch in {len(kept)} layer(s) with renorm, synchronized=True "
                     f"or their own call ({names})")
        return text


#: sharded: ``copy_back`` gathers the weights to the host in batches of about this many
#: bytes (a batch's transfers overlap; the host holds one batch beside the weights)
HOST_BATCH_BYTES = 64 << 20


def _batches(items, sizes, limit):
    """``items`` in order, cut into lists of at most ``limit`` bytes (a larger item alone)."""
    out, size = [], 0
    for item, n in zip(items, sizes):
        if out and size + n > limit:
            yield out
            out, size = [], 0
        out.append(item)
        size += n
    if out:
        yield out


#: the smallest array (bytes) ``copy_back`` writes into the template's own buffer: a fresh
#: buffer for a large array costs its page faults and zeroing (a 34M-parameter MLP + Adam,
#: 400 MB: ~0.2 s per fit on CPU against ~0.02 s into the old buffers); small arrays go in
#: one device_put, which needs no compile
REUSE_BYTES = 1 << 20


def _reusable(olds, news):
    """Indices i where ``news[i]`` (a replica's first copy) can be written into
    ``olds[i]``'s buffer: both on the same one device, the same shape and dtype, large,
    and that buffer held by no other template variable."""
    import jax

    out, seen = [], set()
    for i, (old, new) in enumerate(zip(olds, news)):
        if (not isinstance(old, jax.Array) or old.nbytes < REUSE_BYTES or old.shape != new.shape or old.dtype != new.dtype
                or old.is_deleted() or len(old.devices()) != 1 or old.devices() != new.devices()):
            continue
        buffer = old.unsafe_buffer_pointer()
        if buffer not in seen and buffer != new.unsafe_buffer_pointer():
            seen.add(buffer)
            out.append(i)
    return out


def _into(olds, news):
    """Copies of ``news`` written into ``olds``'s buffers (donated: ``olds`` are deleted)."""
    import jax
    import jax.numpy as jnp

    global _INTO
    if _INTO is None:  # keep_unused: an unused argument would not be donated
        _INTO = jax.jit(lambda olds, news: [jnp.copy(a) for a in news], donate_argnums=0,
                        keep_unused=True)
    return _INTO(olds, news)


_INTO = None


def _equal(pairs):
    """Whether each (template variable, replica variable) pair holds the same bits, on the
    device (a replica value is compared through its first device's copy)."""
    import jax

    todo, out = [], [False] * len(pairs)
    for i, (t, r) in enumerate(pairs):
        a, b = t.value, r.value
        if a.shape == b.shape and a.dtype == b.dtype:
            b = b.addressable_shards[0].data
            todo.append((i, a if a.devices() == b.devices() else jax.device_put(a, b.device), b))
    if todo:
        same = jax.device_get(_same_bits([a for _, a, _ in todo], [b for _, _, b in todo]))
        for (i, _, _), ok in zip(todo, same):
            out[i] = bool(ok)
    return out


def _bits(a):
    import jax
    import jax.numpy as jnp

    if jnp.issubdtype(a.dtype, jnp.floating):
        return jax.lax.bitcast_convert_type(a, jnp.dtype(f"uint{8 * a.dtype.itemsize}"))
    return a


def _same_bits(a, b):
    import jax
    import jax.numpy as jnp

    global _SAME
    if _SAME is None:
        _SAME = jax.jit(lambda xs, ys: [jnp.array_equal(_bits(x), _bits(y))
                                         for x, y in zip(xs, ys)])
    return _SAME(a, b)


_SAME = None
