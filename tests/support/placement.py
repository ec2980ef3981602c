"""A device-placement check that runs on a CPU: the ``meta`` device stands in for the accelerator.

On a CPU machine "no device" and "the device" are the same, so a tensor the code forgot to move is invisible
to a test. Here the model lives on ``meta`` (shapes, no data) while whatever the code builds without naming a
device lands on the CPU, and ``PlacementGuard`` (a ``TorchDispatchMode``) refuses every op whose tensor inputs
sit on more than one device, as CUDA does, and more strictly than torch's own meta kernels (which let
``mm``, ``index_select`` or ``where`` take a CPU operand). A zero-dimensional CPU tensor is allowed beside
any device, as CUDA allows it (a Python scalar's tensor).

Reading a value back from ``meta`` has no data to read: the guard answers ``.item()`` with 0 (floats 0.0)
and a copy to the CPU with zeros of the right shape and dtype, so the code's own read-backs run. A boolean
read back is False for the first ``false_reads`` reads and True after, so a loop that waits on a device flag
(``generate``'s "every sequence finished") runs a few rounds and ends.

Copies between devices (``.to``, ``copy_``) are the sanctioned way across and are not refused; what a test
asserts is that the step, the evaluation or the generation completes under the guard (and, where it says so,
how many values were read back).
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

_CROSSING = {torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default, torch.ops.aten.to.dtype_layout,
             torch.ops.aten._copy_from.default, torch.ops.aten._copy_from_and_resize.default}


class MixedDevices(RuntimeError):
    """An op got tensors of two devices."""


class PlacementGuard(TorchDispatchMode):
    def __init__(self, *, false_reads: int = 3):
        super().__init__()
        self.false_reads = false_reads
        self.reads = 0
        """Values read back from the meta device (``.item()``, ``.tolist()``, ``.cpu()``...)."""
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops += 1
        flat, _ = tree_flatten((args, kwargs))
        tensors = [t for t in flat if isinstance(t, torch.Tensor)]
        devices = {t.device for t in tensors if not (t.device.type == "cpu" and t.dim() == 0)}
        if func not in _CROSSING and len(devices) > 1:
            shapes = ", ".join(f"{t.device.type}{tuple(t.shape)}" for t in tensors)
            raise MixedDevices(f"{func} got tensors on {sorted(d.type for d in devices)}: {shapes}")
        if func is torch.ops.aten._local_scalar_dense.default and args[0].device.type == "meta":
            self.reads += 1
            if args[0].dtype == torch.bool:
                return self.reads > self.false_reads
            return 0.0 if args[0].is_floating_point() else 0
        if func is torch.ops.aten._to_copy.default and args[0].device.type == "meta":
            target = kwargs.get("device")
            if target is not None and torch.device(target).type != "meta":
                self.reads += 1
                return torch.zeros(args[0].shape, dtype=kwargs.get("dtype") or args[0].dtype, device=target)
        if func is torch.ops.aten.copy_.default and args[1].device.type == "meta" and args[0].device.type != "meta":
            self.reads += 1
            return args[0].zero_()
        return func(*args, **kwargs)
