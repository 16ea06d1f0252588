"""`rlinf fit` with one fault injected at the file-system level of the driver, for the fault tests:

    python tests/fault_injection.py kill 4 fit --config ...   # SIGKILL itself mid-way through
                                                               # writing checkpoint iter-000004
    python tests/fault_injection.py disk 4 fit --config ...   # from checkpoint iter-000004 on, the
                                                               # kernel refuses writes past 256 KiB

The rest is the real CLI, trainer, launchers and checkpoint code. ``disk`` uses RLIMIT_FSIZE, which
makes the kernel fail the write (EFBIG) exactly as a full disk fails it (ENOSPC), without needing
a small file system mounted (root); workers started before keep writing normally.
"""

from __future__ import annotations

import os
import resource
import signal
import sys


def inject(mode: str, iteration: int) -> None:
    import safetensors.torch

    import rlinf_lightning.trainer.fit_loop as trainer

    tag = f"iter-{iteration:06d}"
    if mode == "kill":
        save_file = safetensors.torch.save_file

        def save_then_die(tensors, filename, *args, **kwargs):
            save_file(tensors, filename, *args, **kwargs)
            if tag in str(filename):  # the weights are written, the rest of the checkpoint is not
                os.kill(os.getpid(), signal.SIGKILL)

        safetensors.torch.save_file = save_then_die
    elif mode == "disk":
        save_checkpoint = trainer.save_checkpoint

        def save_on_a_full_disk(root, it, *args, **kwargs):
            if it == iteration:
                resource.setrlimit(resource.RLIMIT_FSIZE, (256 * 1024, resource.RLIM_INFINITY))
            return save_checkpoint(root, it, *args, **kwargs)

        trainer.save_checkpoint = save_on_a_full_disk
    else:
        raise SystemExit(f"unknown fault {mode!r}; use kill or disk")


if __name__ == "__main__":
    from rlinf_lightning.cli import main

    inject(sys.argv[1], int(sys.argv[2]))
    sys.exit(main(sys.argv[3:]))
