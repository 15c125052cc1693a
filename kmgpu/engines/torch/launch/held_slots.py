"""A pool launcher's side of the optimizer slots its ranks keep under shard="weights".

Where a fit's state lives then (``launch.snapshots`` says the rest):

- the trainable weights and the optimizer's slots: 1/N on each rank, for the pool's life;
- your model: the whole weights, copied from the snapshot at the call's end (and at the
  epoch ends where its callbacks read them); its optimizer's slots are *held*
  (``optim.held``): they keep the tensors they had, and the ranks keep the current
  values;
- when they are gathered: at the first read of any held slot, before a call that sends
  your model's state to the ranks or whose callbacks may read or set the state
  (``messages.Call.slots_back``), before another model's call on the pool, and before
  the pool closes (``WorkerPool.holder``). Each rank sends its pieces over its pipe
  straight into the held variables' tensors (``messages.SlotsQuery``,
  ``launch.state_pipe``). Nothing is gathered on a rank or copied into a file.
"""

import warnings

import keras

from kmgpu.engines.torch import replicas
from kmgpu.engines.torch.launch import state_pipe
from kmgpu.engines.torch.launch.messages import SlotsQuery
from kmgpu.engines.torch.optim import held


class HeldSlots:
    """The template's optimizer slots that the pool's ranks keep, for one launcher.

    Args:
        launcher: the ``launchers.PoolLauncher`` (its ``in_call`` and ``_synced``).
    """

    def __init__(self, launcher):
        self.launcher = launcher
        self.found = None  # (template, layout, [(variable, index in layout)], pool)

    def hold(self, template, layout, variables, pool):
        """``variables`` (the template's slots a snapshot left out) held until read; their
        values go (``held.empty``): the ranks have the current ones."""
        index = {id(v): i for i, v in enumerate(replicas.transfer_variables(template, layout))}
        self.found = (template, layout, [(v, index[id(v)]) for v in variables], pool)
        held.hold(variables, self.fetch)
        held.empty(variables)
        pool.holder = self

    def replaced_by(self, holds):
        """A snapshot that holds the slots comes (``holds``: per array of the layout,
        whether the snapshot holds it): they are let go unread (its values are loaded
        into them)."""
        if self.found is not None and all(holds[i] for _, i in self.found[2]):
            self._let_go()

    def _let_go(self):
        found, self.found = self.found, None
        for v, _ in found[2]:
            held.let_go(v)
        if found[3].holder is self:
            found[3].holder = None

    def fetch(self):
        """Copy the slots the ranks keep into the template's held variables. Where the
        workers are gone, the variables start again from zeros, as a new optimizer's
        slots do, with a warning."""
        if self.found is None:
            return
        if self.launcher.in_call:
            raise RuntimeError(
                "kmgpu (torch): your model's optimizer state stays in the worker processes "
                "under shard='weights' and cannot be read while a call runs. Read "
                "model.optimizer.variables after the call, or in a callback that is not "
                "known to leave the weights alone (such a callback makes them come back).")
        template, layout, pairs, pool = self.found
        try:
            if pool.closed or not pool.alive():
                raise RuntimeError("the worker processes have ended")
            # each rank's pieces straight into the held variables' tensors
            pipe = state_pipe.DriverPipe(template, layout)
            pool.call([SlotsQuery(None, layout, tuple(i for _, i in pairs))] * pool.world,
                      on_state=pipe)
            if not pipe.complete:
                raise RuntimeError("not every worker sent its pieces")
            self._let_go()
        except Exception as e:
            if self.found is not None:
                self._let_go()
            for v, _ in pairs:
                v.assign(keras.ops.zeros(v.shape, v.dtype))
            warnings.warn(
                f"kmgpu (torch): your model's optimizer state could not be read back from the "
                f"worker processes, where shard='weights' keeps it ({e}); its optimizer's "
                "slots (Adam's moments, say) start again from zeros, as a new optimizer's "
                "do.", RuntimeWarning, stacklevel=3)
            return
        synced = self.launcher._synced
        if synced is not None and synced[0] is pool:  # the ranks hold this state still
            self.launcher._synced = synced[:2] + (replicas.state_versions(template),) + synced[3:]
