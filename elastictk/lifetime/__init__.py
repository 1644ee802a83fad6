"""elastictk.lifetime: process lifetimes, the bottom layer every package may import.

``procfs`` is the one reader of ``/proc``; ``handle`` pins a process by pidfd and start time so a
signal never reaches a reused PID; ``reaper`` makes workers die with their parent and finds a
worker's whole tree; ``deathwatch`` kills the workers' sessions if the agent is SIGKILLed;
``sigflag`` is the one flag a signal handler may raise.
Standard library only, so a worker or a fork-server child can import it.
"""
