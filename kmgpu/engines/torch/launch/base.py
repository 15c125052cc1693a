"""What the torch engine asks of a launcher (``launchers``: how the ranks' processes come
to exist and how a call and its state reach them): ``launchers.PoolLauncher`` and
``in_process.InProcessLauncher`` are the two."""

import abc


class Launcher(abc.ABC):
    """How ranks are started and reached: what the torch engine asks of it.

    Attributes:
        name: what runs the ranks, in words (for describe()).
        device_ids, device_names: the replicas' devices.
        is_interactive_compatible: works from a notebook or REPL.
        runs_callbacks: this process runs the user's callbacks.
    """

    name = "?"
    is_interactive_compatible = False
    runs_callbacks = True
    #: arrays of the template's state the last call sent to the ranks (0: none needed)
    copied_in = None

    @abc.abstractmethod
    def launch(self, call, template, driver, clock):
        """Run ``call`` on every rank, from ``template``'s current state.

        Args:
            call: a ``messages.Call`` (its data as the user passed it).
            template: the user's model: its weights, optimizer state and state rows
                go to the ranks first.
            driver: the ``relay.CallbackDriver`` answering rank 0's events.
            clock: a ``timing.Clock`` to mark the call's parts on.

        Returns:
            One ``RankResult`` per rank, rank order. For fit and evaluate, the first
            one's result is the call's (the same on every rank).
        """

    @abc.abstractmethod
    def load_state(self, template):
        """Put the ranks' latest consistent state (rank 0's) into ``template``; a
        no-op before this call's state reached the ranks."""

    @abc.abstractmethod
    def push_state(self, template):
        """Send ``template``'s state to the ranks during a call (the callbacks set it)."""

    def end_call(self, failed, touched=False):
        """The call is over (``failed``: it raised; ``touched``: a rank's replica changed
        in a call that does not train); free what it held."""

    @abc.abstractmethod
    def rank_weights(self):
        """Every rank's replica weights, rank order (for tests)."""

    @abc.abstractmethod
    def rank_held_bytes(self):
        """Every rank's ``DDPStrategy.held_bytes()``, rank order (for tests)."""

    def worker_pids(self):
        """The worker processes' ids (none in-process)."""
        return []

    def close(self):
        """Free the processes and files (or leave the process group)."""
