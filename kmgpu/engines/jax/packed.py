"""A train step that takes the model's state as a few flat arrays (issue 22).

Keras's JAX ``fit`` passes every variable, optimizer slot and metric as its own array
through its jitted step and back: ResNet-50 has 752. On one H200 the host spends
12 ms per step in that call (about 16 us per array, whatever the batch:
``benchmarks/results/jax-step-profile-h200.md``), more than the GPU's 10 ms at batch
256 and twice its 6.5 ms at 128, so a half batch ran no faster than a full one.

``PackedTrainFunction`` replaces ``model.train_function`` for one ``fit`` call: the
state is packed once into one flat array per (dtype, placement), the jitted step
unpacks it (static slices), runs the model's own ``train_step`` and packs the new
state again, with the packed arrays donated, so each step passes a handful of
arrays. The arithmetic is ``train_step``'s own; slicing and concatenating move bits
unchanged. Keras's loop still sees a state of four lists: they unpack lazily, only
where Keras or a callback reads the variables (``jax_state_sync`` at the end of an
epoch, or a callback's ``self.model`` mid-epoch); after such a sync Keras hands back
the variables' values and they are packed again.

Packing costs the GPU a copy of the state in and out of the flat arrays (the
transformer at batch 32: 0.8 ms of a 7.5 ms step), so it is chosen from a measurement:
in a model's first ``fit`` both steps run ``WINDOW`` steps each, timed, and the faster
stays (``PackedTrainFunction.choice``; describe() shows both times).

Not used (Keras's own step runs): ``run_eagerly``, ``jit_compile=False``,
``steps_per_execution > 1``, several processes, or ``KMGPU_JAX_FAST=0`` in the
environment (``KMGPU_JAX_FAST=packed``: packed from the first step, no measuring).
"""

import collections.abc
import os

ENV = "KMGPU_JAX_FAST"


def mode():
    """``KMGPU_JAX_FAST``: unset or "1": measure both steps, keep the faster; "packed":
    the packed step without measuring; "0": Keras's own step, kmgpu adds nothing."""
    value = os.environ.get(ENV, "1").strip().lower()
    if value in ("0", "false", "no", "off"):
        return "off"
    return "packed" if value == "packed" else "measure"


def enabled():
    """False when the user switched kmgpu's JAX step options off (KMGPU_JAX_FAST=0)."""
    return mode() != "off"


def describe(function):
    """The train step line of describe() for a ``PackedTrainFunction`` (or None)."""
    off = "switch off: KMGPU_JAX_FAST=0"
    undecided = ("Keras's jitted step or kmgpu's packed one (the model state as a few flat "
                 f"arrays), whichever measures faster in the first fit ({off})")
    if function is None or function.arrays is None:
        return undecided
    packed = (f"kmgpu's packed step (the model state as {function.groups} flat array(s) "
              f"instead of {function.arrays})")
    if function.mode == "packed":
        return f"{packed}, KMGPU_JAX_FAST=packed ({off})"
    m = function.measured
    times = ", ".join(f"{k} {1e3 * m[k]:.2f} ms/step" for k in ("keras", "packed") if k in m)
    if function.choice is None:  # a fit shorter than the measurement: no choice yet
        return undecided if not times else (
            f"measuring Keras's jitted step against {packed}: {times} so far ({off})")
    chosen = packed if function.choice == "packed" else "Keras's jitted step"
    return f"{chosen}, measured faster ({times}; {off})"


def applies(model):
    """Whether the packed step can stand in for Keras's jitted step on ``model``."""
    return (enabled() and getattr(model, "compiled", False) and not model.run_eagerly
            and bool(model.jit_compile) and int(model.steps_per_execution or 1) == 1)


class _Layout:
    """Which state leaf goes where: groups of (dtype, placement), offsets, shapes."""

    def __init__(self, leaves):
        import numpy as np
        from jax.sharding import NamedSharding, PartitionSpec

        self.groups = []  # [(dtype, sharding, [leaf index])]
        keys = {}
        for i, leaf in enumerate(leaves):
            sharding = leaf.sharding
            if not sharding.is_fully_replicated:
                key = ("own", i)
            else:  # the same copy on the same devices, whatever the rank
                key = (leaf.dtype, frozenset(sharding.device_set), sharding.memory_kind)
                if isinstance(sharding, NamedSharding):
                    sharding = NamedSharding(sharding.mesh, PartitionSpec(),
                                             memory_kind=sharding.memory_kind)
            if key not in keys:
                keys[key] = len(self.groups)
                self.groups.append((leaf.dtype, sharding, []))
            self.groups[keys[key]][2].append(i)
        self.shapes = [tuple(leaf.shape) for leaf in leaves]
        self.sizes = [int(np.prod(s, dtype=np.int64)) for s in self.shapes]
        # a leaf laid out over the devices (a stateful RNN's rows) travels on its own
        self.single = [not g[1].is_fully_replicated for g in self.groups]

    def pack(self, leaves):
        import jax.numpy as jnp

        out = []
        for (_, _, members), single in zip(self.groups, self.single):
            if single:
                out.append(leaves[members[0]])
            else:
                out.append(jnp.concatenate([jnp.ravel(leaves[i]) for i in members]))
        return out

    def unpack(self, packed):
        leaves = [None] * len(self.shapes)
        for (_, _, members), single, flat in zip(self.groups, self.single, packed):
            if single:
                leaves[members[0]] = flat
                continue
            offset = 0
            for i in members:
                leaves[i] = flat[offset:offset + self.sizes[i]].reshape(self.shapes[i])
                offset += self.sizes[i]
        return leaves

    def shardings(self):
        return [g[1] for g in self.groups]


class _LazyList(collections.abc.Sequence):
    """One of Keras's four state lists, unpacked from the packed arrays when read."""

    def __init__(self, state, index, length):
        self._state, self._index, self._length = state, index, length

    def __len__(self):
        return self._length

    def __getitem__(self, i):
        return self._state.lists()[self._index][i]


class _PackedState(tuple):
    """What the step returns to Keras's loop in place of its state tuple of lists."""

    def __new__(cls, owner, packed, lengths):
        state = super().__new__(cls, [None] * len(lengths))
        return state

    def __init__(self, owner, packed, lengths):
        self._owner, self._packed, self._lists = owner, packed, None
        self._views = [_LazyList(self, i, n) for i, n in enumerate(lengths)]

    def __iter__(self):
        return iter(self._views)

    def __getitem__(self, i):
        return self._views[i]

    def lists(self):
        if self._lists is None:
            self._lists = self._owner.unpack(self._packed)
        return self._lists


class PackedTrainFunction:
    """Stands in for ``model.train_function``: ``(state, iterator) -> (logs, state)``.

    ``mode`` "measure" (the default) runs Keras's own step (the same jitted
    ``train_step``, the state as Keras's lists) and the packed one for ``WINDOW`` steps
    each, after ``WARM`` steps each (the compile), and keeps the faster for good; "packed"
    packs from the first step (``KMGPU_JAX_FAST=packed``).

    Args:
        model: the compiled model whose ``train_step`` runs (Keras's JAX trainer).
    """

    WARM, WINDOW = 2, 6

    def __init__(self, model, mode="measure"):
        self.model, self.mode = model, mode
        self._layout, self._treedef, self._step, self._last = None, None, None, None
        self._keras_step, self._avals = None, None
        self.arrays = self.groups = None
        self.measured = {}  # "keras" / "packed": seconds per step
        self._window = None  # (which, steps so far, start time)

    # -- the two steps ------------------------------------------------------------
    def _build(self, state):
        import jax

        leaves, treedef = jax.tree.flatten(state)
        layout = _Layout(leaves)
        model = self.model
        dtypes = [(tuple(x.shape), x.dtype) for x in leaves]

        def step(packed, data):
            inner = jax.tree.unflatten(treedef, layout.unpack(packed))
            logs, new_state = model.train_step(inner, data)
            new_leaves, new_def = jax.tree.flatten(new_state)
            if new_def != treedef or [(tuple(a.shape), a.dtype) for a in new_leaves] != dtypes:
                raise RuntimeError(
                    "kmgpu: the model's train_step returned a state of another structure "
                    f"than it was given; set {ENV}=0 to run Keras's own step.")
            return logs, layout.pack(new_leaves)

        distributed = any(not isinstance(s, jax.sharding.SingleDeviceSharding)
                          for s in layout.shardings())
        out = (None, layout.shardings()) if distributed else None
        self._step = jax.jit(step, donate_argnums=0, out_shardings=out)
        self._pack = jax.jit(layout.pack, out_shardings=out and out[1])
        self._unpack = jax.jit(layout.unpack)
        # Keras's own step, as its make_train_function builds it
        own = (None, jax.tree.map(lambda a: a.sharding, state)) if distributed else None
        self._keras_step = jax.jit(model.train_step, donate_argnums=0, out_shardings=own)
        self._layout, self._treedef = layout, treedef
        self._avals = [(x.shape, x.dtype, x.sharding) for x in leaves]
        self.arrays, self.groups = len(leaves), len(layout.groups)

    def unpack(self, packed):
        import jax

        state = jax.tree.unflatten(self._treedef, self._unpack(packed))
        return [list(part) for part in state]

    # -- which step runs ----------------------------------------------------------
    @property
    def choice(self):
        """"packed", "keras", or None while measuring."""
        if self.mode == "packed":
            return "packed"
        if len(self.measured) == 2:
            return min(self.measured, key=self.measured.get)
        return None

    def _which(self):
        return self.choice or ("keras" if "keras" not in self.measured else "packed")

    def _clock(self, which, synced, outputs):
        """Times WINDOW steps of ``which`` after WARM; a sync by Keras (epoch end,
        a callback reading the weights) restarts the window."""
        import time

        import jax

        w = self._window
        if w is None or w[0] != which or synced:
            w = self._window = [which, 0, None]
        w[1] += 1
        if w[1] == self.WARM:
            jax.block_until_ready(outputs)
            w[2] = time.perf_counter()
        elif w[1] == self.WARM + self.WINDOW:
            jax.block_until_ready(outputs)
            self.measured[which] = (time.perf_counter() - w[2]) / self.WINDOW
            self._window = None

    def __call__(self, state, iterator):
        import jax

        data = next(iterator)
        synced = self._last is None or state is not self._last
        if synced:  # Keras handed the variables' values (or a state it kept)
            if isinstance(state, _PackedState):
                state = tuple(state.lists())
            leaves, treedef = jax.tree.flatten(state)
            if (self._step is None or treedef != self._treedef
                    or [(x.shape, x.dtype, x.sharding) for x in leaves] != self._avals):
                self._build(state)
                self.measured, self._window = {}, None
        which = self._which()
        if which == "keras":
            if isinstance(state, _PackedState):
                state = tuple(state.lists())
            logs, out = self._keras_step(state, data)
        else:
            packed = state._packed if isinstance(state, _PackedState) else self._pack(
                jax.tree.leaves(state))
            logs, packed = self._step(packed, data)
            out = _PackedState(self, packed, [len(part) for part in state])
        if self.choice is None:
            self._clock(which, synced, out._packed if which == "packed" else out)
        self._last = out
        return logs, out
