"""Preloaded by the benchmark's forkserver only (never imported by the main process): the forkserver
records the SIGINT handler after its preloads and gives it to every process it forks, so the workers
ignore Ctrl-C from their first instruction. A terminal sends SIGINT to the whole process group; the
main process then stops the suite and kills the worker (a worker that died of the signal while it was
being started would print a traceback and break the pool)."""

import signal

signal.signal(signal.SIGINT, signal.SIG_IGN)
