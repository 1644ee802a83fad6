"""elastictk under Slurm: defaults from ``srun``'s variables, its node list syntax, and the
``scontrol`` calls a job makes on Slurm (requeue after a pre-emption, drain a bad node).

Of elastictk's layers it imports only the store (``wait``: a TCPStore ping): ``elastictk.cli``
reads the defaults, ``elastictk.run`` waits for the store's host and asks for the requeue; the
agent's ``--slurm-drain`` listener asks for the drain. See docs/slurm.md.
"""
from .defaults import LaunchDefaults, launch_defaults, node_id, store_port
from .env import SlurmEnvError, SlurmJob, read, under_srun
from .nodelist import MAX_HOSTS, NodelistError, expand, scontrol_hostnames
from .scontrol import Answer, drain, drain_reason, job_id, requeue, this_node

__all__ = [
    "Answer", "LaunchDefaults", "MAX_HOSTS", "NodelistError", "SlurmEnvError", "SlurmJob", "drain",
    "drain_reason", "expand", "job_id", "launch_defaults", "node_id", "read", "requeue",
    "scontrol_hostnames", "store_port", "this_node", "under_srun",
]
