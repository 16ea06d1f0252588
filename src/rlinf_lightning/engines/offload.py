"""Context switching: move a stage's state off its device between turns, and back.

On an accelerator the state goes to host memory; on a CPU slot it goes to a spill file on local
disk (the host memory *is* the device there), streamed one tensor at a time so offloading never
holds a second copy, and a collocated plan with offload keeps only the active stage's weights and
optimizer state in RAM. ``onload`` restores the exact tensors. The spill file is unlinked as soon
as it is created and lives on through its open descriptor, so it is gone when the process ends,
however it ends (even SIGKILL).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator

import torch


class Offloader:
    """Offloads a module's parameters and buffers, and optionally an optimizer's state tensors.

    Args:
        device: the device the state lives on while active.
        spill_dir: where CPU spill files go (default: the system temporary directory).
    """

    def __init__(self, device: str, spill_dir: str | None = None) -> None:
        self.device = torch.device(device)
        self.spill_dir = spill_dir
        self.offloaded = False
        self._spill = None  # the open, already unlinked spill file while offloaded on CPU

    def _tensors(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> Iterator:
        """(key, getter, setter) for every tensor to move."""
        for name, p in module.named_parameters():
            yield f"param.{name}", p, lambda t, p=p: setattr(p, "data", t)
        for name, b in module.named_buffers():
            yield f"buffer.{name}", b, lambda t, b=b: setattr(b, "data", t)
        if optimizer is not None:
            for i, state in enumerate(optimizer.state.values()):
                for k, v in state.items():
                    if isinstance(v, torch.Tensor) and v.dim() > 0:
                        yield f"optim.{i}.{k}", v, lambda t, s=state, k=k: s.__setitem__(k, t)

    def offload(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
        if self.offloaded:
            return
        items = list(self._tensors(module, optimizer))
        if self.device.type == "cpu":
            fd, path = tempfile.mkstemp(prefix="rlinf-offload-", suffix=".bin", dir=self.spill_dir)
            os.unlink(path)
            self._spill = f = os.fdopen(fd, "w+b")
            # stream tensor by tensor, each freed as soon as it is on disk: no second copy in RAM
            self._layout = []
            for key, t, set_ in items:
                data = t.detach().contiguous()
                f.write(memoryview(data.view(-1).view(torch.uint8).numpy()))
                self._layout.append((key, data.dtype, tuple(data.shape)))
                set_(torch.empty(0, dtype=t.dtype))
                del data
            f.flush()
        else:
            for _, t, set_ in items:
                # straight into pinned memory (`.to("cpu").pin_memory()` would copy twice); the
                # device block freed here is reused only by work queued after the copy
                host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                set_(host.copy_(t.detach(), non_blocking=True))
            torch.cuda.synchronize(self.device)  # the host copies are complete before use
            torch.cuda.empty_cache()
        self.offloaded = True

    def onload(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
        if not self.offloaded:
            return
        items = list(self._tensors(module, optimizer))
        if self.device.type == "cpu":
            setters = {key: set_ for key, _, set_ in items}
            f, self._spill = self._spill, None
            with f:
                f.seek(0)
                for key, dtype, shape in self._layout:
                    t = torch.empty(shape, dtype=dtype)
                    f.readinto(memoryview(t.view(-1).view(torch.uint8).numpy()))
                    setters[key](t)
        else:
            for _, t, set_ in items:
                set_(t.to(self.device, non_blocking=True))
        self.offloaded = False
