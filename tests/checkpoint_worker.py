"""Run by test_checkpoint.py in a subprocess: train, checkpoint, then die by SIGKILL."""

import os
import signal
import sys

import jaxamp
from tests.helpers.poisson import cached_problem, poisoned


def main(directory, steps):
    state, step, _, batch, _ = cached_problem("fp16")
    for i in range(steps):
        state, _ = step(state, batch(poisoned(i)))
    jaxamp.Checkpointer(directory).save(state)
    print("saved", int(state.step), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # no clean shutdown: the checkpoint must already be whole


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
