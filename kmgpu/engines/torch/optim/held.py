"""Your model's optimizer slots while a torch pool's ranks keep them (shard="weights").

After a sharded fit in a worker pool, the ranks hold the optimizer's slots (Adam's two
moments: 8 of the 12 bytes per parameter of the state) in pieces. Copying them into your
model at every call's end would put a whole copy of them in a snapshot file and another in
your model, the host memory sharding exists to save. So your model's slot variables are
*held*: they keep their tensor objects, whose memory is given back (``empty``), and the
first read of any of them (``value``: ``numpy()``, ``np.asarray``, ``model.save``, a plain
Keras ``fit``, an op) fetches every held slot from the ranks first (``fetch``: each rank
writes its pieces into the state file, nothing is gathered on a rank), then reads it.
Assigning a held variable lets it go unread. The class of a held variable is swapped for
a subclass overriding the two (a row of ``kmgpu/engines/torch/keras_fixes.py``).
"""

_HOLDING = {}  # a variable class -> its holding subclass


def hold(variables, fetch):
    """Hold ``variables`` until one of them is read; then ``fetch()`` runs once first,
    and must let every one of them go (``let_go``) and give each its value."""
    for v in variables:
        let_go(v)
        v._kmgpu_fetch = fetch
        v.__class__ = _holding(type(v))


def empty(variables):
    """Give the memory of held ``variables`` back: each keeps its tensor object (its
    dtype, shape and device), over fresh storage nothing has written (the allocator maps
    large blocks untouched, so they cost no memory until the fetch fills them)."""
    import torch

    from kmgpu.engines import heap

    with torch.no_grad():
        for v in variables:
            v._value.data = torch.empty(0, dtype=v._value.dtype, device=v._value.device)
        heap.trim_heap()  # the freed values' pages, before fresh storage is taken
        for v in variables:
            v._value.data = torch.empty(tuple(v.shape),
                                        dtype=v._value.dtype, device=v._value.device)


def held(variable):
    """Whether ``variable`` is held (``hold``)."""
    return type(variable) in _HOLDING.values()


def raw(variable):
    """``variable``'s tensor without fetching a held one (for bookkeeping that only
    looks at which tensor it is and where it lives)."""
    return variable._value if held(variable) else variable.value


def let_go(variable):
    """``variable`` a plain variable again, its tensor unchanged."""
    if held(variable):
        variable.__class__ = type(variable).__mro__[1]
        del variable._kmgpu_fetch


def _holding(base):
    cls = _HOLDING.get(base)
    if cls is None:
        class Holding(base):
            """A Keras variable whose value the ranks keep until it is read (``hold``)."""

            @property
            def value(self):
                fetch = self._kmgpu_fetch
                fetch()
                let_go(self)  # fetch lets it go; so that a failed fetch cannot loop
                return self.value

            def _direct_assign(self, value):
                let_go(self)
                self._direct_assign(value)

        Holding.__name__, Holding.__qualname__ = base.__name__, base.__qualname__
        cls = _HOLDING[base] = Holding
    return cls
