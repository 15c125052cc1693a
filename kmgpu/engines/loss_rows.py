"""How a model's own losses (``add_loss``, weight regularizers) add up over replicas.

On one device Keras adds each of ``model.losses`` once per batch, computed on the whole
batch. A replica computes it on its own rows, so the replicas' values add up to one
device's only by a rule that depends on how the loss depends on the rows:

- a mean over rows, ``L(B) = (n1 L(B1) + n2 L(B2)) / n``, and a loss that does not depend
  on the rows (a weight regularizer): each replica's value weighed by its share of the
  batch's rows ("share");
- a sum over rows, ``L(B) = L(B1) + L(B2)``: each replica's value counts whole ("whole");
- anything else (a batch statistic, a mean of the whole batch squared): no rule gives
  one device's value; TensorFlow and torch refuse such a call.

Nothing in Keras says which a loss is, so kmgpu measures it (``probe``) on the replicas'
own split of a batch: the loss of the whole batch against those of the contiguous row
blocks the replicas get (one forward pass each), in training mode and in inference mode.
The model's variables (random seeds included) are restored after each pass. It probes
every split a call's batches have (``split_sizes``: how the engine cuts that many rows),
once per model and split: the first batch and the last partial one of arrays before any
work; a dataset's (generator, PyDataset, ``tf.data``, DataLoader) each new one when its
batch arrives (``batch_checks``). A split whose rule differs from the one already taken,
or fits no rule, is refused (before any work, or at that batch, the model keeping the
last completed step).
A batch that only one replica gets rows of needs no rule (it is that replica's loss).
Only models with a layer written outside Keras are probed: Keras's own layers add only
activity regularizers, which Keras divides by the batch size (a mean). JAX computes
every loss on the global batch (one jit over the sharded batch) and needs no rule.
A stateful RNN model is probed alike: each pass runs from the matching rows of its
states (the replicas own contiguous state rows), its own states left as they were.
Limits: the probe sees only the batches it runs on, with the weights of that moment. A
loss whose form depends on the data's values rather than its row count (a branch on a
batch statistic) is refused when a probed batch takes the branch differently on the
whole batch and on a part; on a later batch of a probed split it is weighed by the rule
probed before, unseen (README: "Not covered").
"""

import weakref

from kmgpu.engines import state_keras_fixes

SHARE, WHOLE = "share", "whole"

#: model -> {training: (rule per entry of model.losses) or the reason none fits,
#: "rows": the splits probed (rows per replica)}
_RULES = weakref.WeakKeyDictionary()


def rules(model, training):
    """The probed rule of each of ``model.losses`` (``SHARE`` / ``WHOLE``) for a pass in
    ``training`` mode; None when not probed (every one weighs by share)."""
    found = _RULES.get(model, {}).get(bool(training))
    return found if isinstance(found, tuple) else None


def carried(model):
    """The probe's result for a replica of ``model`` (``models.carried``): picklable."""
    found = _RULES.get(model)
    return {k: (set(v) if k == "rows" else v) for k, v in found.items()} if found else None


def load(replica, found):
    """Give ``replica`` the probe's result of its template (``carried``)."""
    if found:
        _RULES[replica] = {k: (set(v) if k == "rows" else v) for k, v in found.items()}


def needs_probe(model):
    """True when a layer of ``model`` (or the model) is written outside Keras: only such
    code may call ``add_loss`` in other ways than Keras's activity regularizers."""
    return any(not type(layer).__module__.startswith("keras.")
               for layer in model._flatten_layers(include_self=True))


def split_sizes(n, replicas, rule="even"):
    """The rows each of ``replicas`` replicas gets of a batch of ``n``: "even", contiguous
    blocks whose sizes differ by at most one (torch; TensorFlow's per-replica feed and
    ``*_on_batch``); "ceil", ceil(n / replicas) each in turn until the rows run out
    (``tf.distribute``'s split of a ``tf.data`` batch: 6 rows on 4 replicas 2, 2, 2, 0)."""
    replicas = max(int(replicas), 1)
    if rule == "ceil":
        q = -(-n // replicas)
        return [max(0, min(q, n - r * q)) for r in range(replicas)]
    q, rem = divmod(n, replicas)
    return [q + (r < rem) for r in range(replicas)]


def probed_splits(model):
    """The splits (rows per replica) ``model``'s own losses were probed on."""
    return set(_RULES.get(model, {}).get("rows", ()))


def probed(model, n, replicas=2, rule="even"):
    """True when ``model``'s own losses were probed on this split of ``n`` rows already."""
    return tuple(split_sizes(n, replicas, rule)) in _RULES.get(model, {}).get("rows", ())


def num_rows(x):
    """The rows of the batch ``x`` (its first leaf's first axis; 0 for none)."""
    import keras
    import numpy as np

    leaves = [a for a in keras.tree.flatten(x) if a is not None]
    return int(np.shape(leaves[0])[0]) if leaves else 0


def check(model, x, uses_loss, replicas=2, late=False, rule="even"):
    """Probe ``model``'s own losses on the batch ``x`` split over ``replicas`` by ``rule``
    (``probe``, ``split_sizes``) unless a batch split so was probed already, and refuse a
    call that computes a loss (``uses_loss``) when one of them is neither a mean nor a sum
    over rows nor independent of them, or weighs by another rule on another split.
    ``late``: the step already runs (``batch_checks``), weighing every loss by share
    where nothing was probed yet, so a sum found now is refused too.

    Raises:
        NotImplementedError: such a loss, with what to do instead.
    """
    if x is not None and needs_probe(model):
        n = num_rows(x)
        key = tuple(split_sizes(n, replicas, rule))
        entry = _RULES.setdefault(model, {})
        seen = entry.setdefault("rows", set())
        if key not in seen:
            found = probe(model, x, replicas, rule)
            seen.add(key)
            for training, got in (found or {}).items():
                taken = entry.get(training)
                if taken is None and late and isinstance(got, tuple):
                    taken = (SHARE,) * len(got)  # what the running step applies
                if taken is None or isinstance(got, str):
                    entry[training] = got if taken is None or isinstance(taken, tuple) \
                        else taken
                elif isinstance(taken, tuple) and got != taken:
                    entry[training] = (
                        f"the model's own losses weigh as {list(got)} on a batch "
                        f"of {n} rows split {list(key)} but as {list(taken)} on the batches "
                        f"before it: their form changes with the batch's rows")
    if not uses_loss:
        return
    for training in (True, False):
        found = _RULES.get(model, {}).get(training)
        if isinstance(found, str):
            raise NotImplementedError(
                f"kmgpu: {found} in {'training' if training else 'inference'} mode; it is "
                "neither a mean nor a sum over rows, nor independent of them (measured on "
                "each row count of the call's batches: the loss of all its rows against "
                "those of the replicas' parts of them). Each replica computes the model's "
                "own losses on its part of the batch, so no weighing of the replicas' "
                "values gives one device's. Write it as a mean (or a sum) over the batch's "
                "rows, compute it in a compiled loss (compile(loss=...)) or a model's own "
                "compute_loss on the global batch's terms, or use the JAX backend (it "
                "computes the loss on the global batch).")


def probe(model, x, replicas=2, rule="even"):
    """How each of ``model.losses`` depends on the rows of the batch ``x``, measured on
    the contiguous row blocks ``replicas`` replicas get of it (``split_sizes``).

    Returns:
        {training: (rule per loss) or a text naming the loss no rule fits}, for
        training=True and False; None when there is nothing to probe (unbuilt, fewer
        than 2 replicas with rows: one replica's loss is the batch's) or the model
        cannot run on fewer rows. A stateful RNN runs each part from those rows of its
        states (``state_keras_fixes.StateRows``), which are left as they were.
    """
    import keras
    import numpy as np

    n = num_rows(x)
    sizes = [size for size in split_sizes(n, replicas, rule) if size]
    if len(sizes) < 2 or not model.built:
        return None
    bounds = np.cumsum([0] + sizes)
    parts = [x] + [keras.tree.map_structure(lambda a, s=slice(lo, hi): a[s], x)
                   for lo, hi in zip(bounds[:-1], bounds[1:])]
    saved = [np.array(keras.ops.convert_to_numpy(v.value)) for v in model.variables]
    spans = [(0, n)] + [(int(lo), int(hi)) for lo, hi in zip(bounds[:-1], bounds[1:])]
    found = {}
    try:
        with _torch_rng(), state_keras_fixes.StateRows(model, n) as states:
            for training in (True, False):
                values = []
                for part, span in zip(parts, spans):
                    states.use(*span)  # a stateful RNN: this part's rows of the states
                    model(part, training=training)
                    values.append([float(np.sum(keras.ops.convert_to_numpy(loss)))
                                   for loss in model.losses])
                    for v, a in zip(model.variables, saved):
                        v.assign(a)
                found[training] = _classify(values, n, sizes)
    except Exception:  # cannot run on these rows: not probed
        for v, a in zip(model.variables, saved):
            v.assign(a)
        return None
    if isinstance(found[True], str) and isinstance(found[False], tuple):
        # random layers in training mode draw differently in the passes: the
        # inference passes show the losses' form
        found[True] = found[False]
    return found


def _classify(values, n, sizes):
    """The rule of each loss from its values on (all rows, each replica's part);
    ``sizes``: the parts' rows (an int: the first of two parts)."""
    if isinstance(sizes, int):
        sizes = [sizes, n - sizes]
    if len({len(v) for v in values}) != 1:
        return "the number of the model's own losses changes with the rows"
    rules = []
    for i, (whole, *parts) in enumerate(zip(*values)):
        tolerance = 1e-4 * max(abs(whole), *map(abs, parts), 1e-6)
        if abs(whole - sum(s * v for s, v in zip(sizes, parts)) / n) <= tolerance:
            rules.append(SHARE)  # a mean over rows, or no dependence on them
        elif abs(whole - sum(parts)) <= tolerance:
            rules.append(WHOLE)
        else:
            shown = ", ".join(f"{v:.6g}" for v in parts)
            return (f"the model's own loss number {i + 1} of {len(values[0])} (model.losses"
                    f"[{i}], from add_loss) is {whole:.6g} on a batch's {n} rows and "
                    f"{shown} on the replicas' parts of {sizes} rows")
    return tuple(rules)


def _torch_rng():
    """torch's own random state kept as it was (Keras's torch dropout draws from it)."""
    import contextlib

    import keras

    if keras.backend.backend() != "torch":
        return contextlib.nullcontext()
    import torch

    return torch.random.fork_rng(devices=[])


# -- the first batch of a call, for the checks before any work ---------------------------
def first_batch(kwargs, whole=False):
    """The first batch of a call's data as (x, y, sample_weight), read without changing
    what the call will read: arrays sliced (``batch_size`` rows, or all of them for
    ``whole``: the ``*_on_batch`` methods), a PyDataset's item 0, a ``tf.data`` dataset's
    first element (a new iterator, as Keras's own build takes it), a map-style torch
    ``DataLoader``'s first batch collated from its dataset, and a generator's first
    batch, given back in front of the rest.

    Returns:
        (kwargs, with a generator peeked at replaced by one that yields that batch
        first; the batch, or None for data it cannot read so, e.g. an iterable torch
        dataset).
    """
    import inspect

    import keras

    from kmgpu.checks import is_dataset

    x = kwargs.get("x")
    if x is None:
        return kwargs, None
    if not is_dataset(x):
        rows = None if whole else int(kwargs.get("batch_size") or 32)
        batch = tuple(keras.tree.map_structure(lambda a: a[:rows], kwargs.get(key))
                      if kwargs.get(key) is not None else None
                      for key in ("x", "y", "sample_weight"))
        return kwargs, batch
    try:
        if isinstance(x, keras.utils.PyDataset):
            batch = x[0]
        elif hasattr(x, "element_spec") and hasattr(x, "take"):  # tf.data
            batch = next(iter(x.take(1)))
        elif hasattr(x, "collate_fn") and hasattr(x, "dataset"):  # torch DataLoader
            size = x.batch_size
            if not size or not hasattr(x.dataset, "__getitem__"):
                return kwargs, None
            batch = x.collate_fn([x.dataset[i] for i in range(min(size, len(x.dataset)))])
        elif inspect.isgenerator(x) or hasattr(x, "__next__"):
            batch = next(x)
            kwargs = dict(kwargs, x=_in_front(batch, x))
        else:
            return kwargs, None
    except (StopIteration, IndexError, TypeError):
        return kwargs, None
    batch = tuple(batch) if isinstance(batch, (tuple, list)) else (batch,)
    x, y, sw = keras.utils.unpack_x_y_sample_weight(batch)
    return kwargs, tuple(None if part is None else keras.tree.map_structure(_numpy, part)
                         for part in (x, y, sw))


def _in_front(first, rest):
    yield first
    yield from rest


def _numpy(a):
    import numpy as np

    if hasattr(a, "detach"):  # torch
        a = a.detach().cpu()
    return np.asarray(a)
