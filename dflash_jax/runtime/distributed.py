"""Several processes, one program: JAX's multi-controller runtime under the command line and the API.

Every process runs the same program over one global mesh (``jax.distributed``): the mesh of
:func:`dflash_jax.runtime.sharding.parse_mesh` spans every process's devices, the parameters and the
decode state are laid out on it, and each jitted step runs on all of them at once. What this
module adds: :func:`initialize` joins the group (the names of ``jax.distributed.initialize``; on
a GPU or TPU cluster JAX finds what is omitted), :func:`fetch` reads arrays on the host whatever
their layout (rows on another process's devices are gathered, so every process calls it at the
same point of the program), and :func:`is_leader` says which process prints.
"""

from __future__ import annotations

import os
import sys
import warnings
import jax
from dflash_jax.errors import DFlashError


JOIN_TIMEOUT_S = 120
"""Seconds a process waits for the others to join (JAX's default, 300, looked like a hang)."""
HEARTBEAT_TIMEOUT_S = 30
"""Seconds without a heartbeat after which JAX's coordination service ends the group (a process
that died takes the others down with an error instead of leaving them blocked)."""


def initialize(coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None) -> bool:
    """Joins the process group when any of the three is given (``--coordinator HOST:PORT``,
    ``--num-processes N``, ``--process-id I``), or when none is but a cluster manager runs this
    program as one of several processes (SLURM's ``srun -n 2``, ``mpirun``, a TPU pod: JAX reads
    the three from it); returns whether it did. Call it before anything
    else uses JAX. On the CPU backend the processes' collectives run over gloo. It says on stderr
    what it waits for: a process waits :data:`JOIN_TIMEOUT_S` for the others (then JAX ends it),
    and one that dies later ends the group after :data:`HEARTBEAT_TIMEOUT_S`.

    Raises:
      DFlashError: a coordinator that is not ``HOST:PORT``, a count below 1 or an id outside
        ``[0, N)`` (naming the option), or a group that could not be joined.
    """
    if coordinator is None and num_processes is None and process_id is None:
        cluster = _cluster_of_several()
        if cluster is None:
            return False
        print(f"dflash_jax: {cluster} found: joining its processes (--coordinator, --num-processes, --process-id from it)",
              file=sys.stderr, flush=True)
    if coordinator is not None and (":" not in coordinator or not coordinator.rsplit(":", 1)[1].isdigit()):
        raise DFlashError("--coordinator", f"got {coordinator!r}", "HOST:PORT of process 0, e.g. 127.0.0.1:1234")
    if num_processes is not None and num_processes < 1:
        raise DFlashError("--num-processes", f"got {num_processes}", "an integer >= 1")
    if process_id is not None and not 0 <= process_id < (num_processes or process_id + 1):
        raise DFlashError("--process-id", f"got {process_id}", f"an integer in [0, {num_processes})")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    _native_output_to_stderr()
    who = f"process {process_id if process_id is not None else '?'} of {num_processes or '?'}"
    print(f"dflash_jax: joining {who} at {coordinator or 'the cluster coordinator'} (waits up to {JOIN_TIMEOUT_S} s for the others)",
          file=sys.stderr, flush=True)
    try:
        jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes, process_id=process_id,
                                   initialization_timeout=JOIN_TIMEOUT_S, heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT_S)
    except (RuntimeError, ValueError) as e:
        raise DFlashError("--coordinator", f"could not join the group of processes ({e})",
                          "every process started with the same --coordinator and --num-processes and its own --process-id") from e
    if num_processes is not None and jax.process_count() != num_processes:  # the coordinator's count decides
        raise DFlashError("--num-processes", f"{num_processes} here, but the group at {coordinator} has {jax.process_count()}",
                          "the same --num-processes on every process")
    return True


def _cluster_of_several() -> str | None:
    """The name of the cluster manager JAX detects from the environment (SLURM, Open MPI, a TPU
    pod, Kubernetes), when it runs this program as one of several processes; ``None`` otherwise
    (one process, or no manager: nothing to join)."""
    from jax._src import clusters  # JAX's own detection (what jax.distributed.initialize() uses); no public accessor

    try:
        with warnings.catch_warnings():  # Kubernetes without its client package warns: not ours to say
            warnings.simplefilter("ignore")
            env = next((c for c in clusters.ClusterEnv._cluster_types if not c.opt_in_only_method and c.is_env_present()), None)
            return None if env is None or env.get_process_count() < 2 else env.__name__
    except Exception:  # a manager's variables half set, or its metadata server unreachable: run as one process
        return None


def _native_output_to_stderr() -> None:
    """Points file descriptor 1 at stderr and Python's ``sys.stdout`` at the original stdout:
    the collectives' native library prints a line for each group it connects
    (``[Gloo] Rank 0 is connected to 1 peer ranks``) on stdout, which would break ``--json``."""
    sys.stdout.flush()
    out = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = os.fdopen(out, "w", buffering=1, encoding=sys.stdout.encoding or "utf-8")


def is_leader() -> bool:
    """Whether this is process 0 (the one that prints and, for a server, listens)."""
    return jax.process_index() == 0


def process_index() -> int:
    """This process's index in the group (0 alone)."""
    return jax.process_index()


def process_count() -> int:
    """The processes in the group (1 alone)."""
    return jax.process_count()


def fetch(tree):
    """``jax.device_get(tree)``, with every array split over devices of other processes gathered
    first (``multihost_utils.process_allgather``): a collective, so every process calls it at the
    same point. One process: ``jax.device_get`` itself."""
    if jax.process_count() == 1:
        return jax.device_get(tree)
    from jax.experimental import multihost_utils

    def one(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable and not x.is_fully_replicated:
            return multihost_utils.process_allgather(x, tiled=True)
        return x

    return jax.device_get(jax.tree_util.tree_map(one, tree))


def everywhere(flag: bool) -> bool:
    """Whether ``flag`` holds on every process (a collective; ``flag`` itself with one process)."""
    if jax.process_count() == 1:
        return bool(flag)
    import numpy as np
    from jax.experimental import multihost_utils

    return bool(np.all(multihost_utils.process_allgather(np.asarray(bool(flag)))))


def leaders(tree):
    """Process 0's values of ``tree`` (numpy arrays, the same shapes on every process), on every
    process (a collective; ``tree`` itself with one process)."""
    if jax.process_count() == 1:
        return tree
    from jax.experimental import multihost_utils

    return multihost_utils.broadcast_one_to_all(tree)


class Broadcast:
    """Process 0's messages to every other process, in the order sent: the control plane of a
    group whose process 0 decides what all of them run (a server's schedule, see
    :mod:`dflash_jax.serve.follow`).

    Messages go through the key-value store of JAX's coordination service (the one every process
    joined in :func:`initialize`), not through a device collective: nothing is compiled, a message
    of any size costs one round trip to the coordinator, and a process waiting for the next one
    uses no device and no CPU however long the wait (a collective would time out under an idle
    server). Message ``n`` is the key ``NAME/EPOCH/n``; every :data:`EPOCH` messages each process
    says how far it has read, and process 0 deletes the epochs all have read, so a server running
    for weeks keeps at most a few epochs in the coordinator's memory. Messages are pickled: they
    are exchanged between the processes of one program, which all joined the same coordinator.

    Args:
      name: the channel's key prefix (one channel per name in a group).
    """

    EPOCH = 256

    def __init__(self, name: str):
        from jax._src import distributed as jax_distributed  # the coordination service's client (no public accessor)

        self.name, self.sent = name, 0
        self._client = jax_distributed.global_state.client
        self._deleted = 0  # epochs below this are gone
        if self._client is None:
            raise DFlashError("--coordinator", "not given (a Broadcast needs a group of processes)", "--coordinator, --num-processes, --process-id")

    def send(self, message) -> None:
        """Sends ``message`` (anything picklable) to every other process (process 0 only)."""
        import pickle

        self._client.key_value_set_bytes(f"{self.name}/{self.sent // self.EPOCH}/{self.sent}", pickle.dumps(message))
        self.sent += 1
        if self.sent % self.EPOCH == 0:
            self._forget_read()

    def receive(self, poll_s: float = 10.0):
        """The next message from process 0 (not process 0): waits as long as it takes; a process 0
        that died ends this process through JAX's heartbeat (:data:`HEARTBEAT_TIMEOUT_S`).

        Raises:
          DFlashError: the coordination service failed (naming it).
        """
        import pickle

        key = f"{self.name}/{self.sent // self.EPOCH}/{self.sent}"
        while True:
            try:
                data = self._client.blocking_key_value_get_bytes(key, int(poll_s * 1000))
                break
            except jax.errors.JaxRuntimeError as e:
                if "DEADLINE_EXCEEDED" not in str(e):
                    raise DFlashError("--coordinator", f"the group's coordination service failed ({e})", "process 0 running") from e
        self.sent += 1
        if self.sent % self.EPOCH == 0:
            self._client.key_value_set(f"{self.name}/read/{jax.process_index()}", str(self.sent // self.EPOCH), allow_overwrite=True)
        return pickle.loads(data)

    def _forget_read(self) -> None:
        """Deletes the epochs every process has read (process 0, once an epoch)."""
        read = []
        for p in range(1, jax.process_count()):
            try:
                read.append(int(self._client.key_value_try_get(f"{self.name}/read/{p}")))
            except jax.errors.JaxRuntimeError:  # NOT_FOUND: that process has not finished an epoch yet
                read.append(0)
        while self._deleted < min(read, default=self.sent // self.EPOCH):
            self._client.key_value_delete(f"{self.name}/{self._deleted}")
            self._deleted += 1
