"""Session runs through IO binding with buffers that stay put, as onnxruntime's CUDA graphs need.

A captured CUDA graph replays kernels on the addresses it was captured with, so each input and output shape gets
its own buffers on the device, bound once; a call copies its pictures into them and replays. onnxruntime keeps one
graph per `gpu_graph_id`, so each shape gets an id too. Imports neither torch nor detectron2.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

GRAPH_ID = "gpu_graph_id"  # onnxruntime's run option: which captured graph a run replays (-1: none)


@dataclass
class _Slot:
    binding: Any
    inputs: dict[str, Any]  # name → OrtValue on the device
    run_options: Any
    keep: list  # what the input OrtValues may wrap (CPU buffers), alive as long as they are
    outputs_fixed: bool = False


class BoundRuns:
    """Runs `session` on feeds of any shape; feeds of one shape (and dtype) always use the same device buffers.
    `device`: onnxruntime's name for where the buffers live ("cuda", or "cpu" where there is no GPU); `graphs`:
    tag each shape's runs with its own graph id (a session created with `enable_cuda_graph` captures it on the first
    run and replays it after)."""

    def __init__(self, session, output_names, device: str = "cuda", device_id: int = 0, graphs: bool = True):
        self.session, self.output_names = session, list(output_names)
        self.device, self.device_id, self.graphs = device, device_id, graphs
        self._slots: dict[tuple, _Slot] = {}
        self._lock = threading.Lock()  # the buffers are shared: one run at a time (replays serialise anyway)

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The outputs as arrays of their own (the next run overwrites the bound buffers, never what was returned)."""
        key = tuple((name, a.shape, a.dtype.str) for name, a in feeds.items())
        with self._lock:
            return self._run(self._slots.get(key) or self._bind(key, feeds), feeds)

    def _run(self, slot: _Slot, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        for name, array in feeds.items():
            slot.inputs[name].update_inplace(np.ascontiguousarray(array))
        self.session.run_with_iobinding(slot.binding, slot.run_options)
        if not slot.outputs_fixed:  # what onnxruntime allocated on the first run, bound for every later one (the
            for name, value in zip(self.output_names, slot.binding.get_outputs()):  # run it captures included)
                slot.binding.bind_ortvalue_output(name, value)
            slot.outputs_fixed = True
        outputs = slot.binding.copy_outputs_to_cpu()
        return {name: np.array(out, copy=True) for name, out in zip(self.output_names, outputs)}

    @property
    def shapes(self) -> int:
        """How many shapes have buffers (and, with graphs, a captured graph) so far."""
        return len(self._slots)

    def _bind(self, key: tuple, feeds: dict[str, np.ndarray]) -> _Slot:
        import onnxruntime as ort

        binding = self.session.io_binding()
        inputs, host_copies = {}, []
        for name, array in feeds.items():  # a buffer of its own: on the CPU an OrtValue wraps the array it is given
            own = np.array(array, order="C", copy=True)
            inputs[name] = ort.OrtValue.ortvalue_from_numpy(own, self.device, self.device_id)
            binding.bind_ortvalue_input(name, inputs[name])
            host_copies.append(own)
        for name in self.output_names:  # onnxruntime allocates them on the first run (sizes known only then)
            binding.bind_output(name, self.device, self.device_id)
        run_options = ort.RunOptions()
        if self.graphs:
            run_options.add_run_config_entry(GRAPH_ID, str(len(self._slots)))
        self._slots[key] = slot = _Slot(binding, inputs, run_options, host_copies)
        return slot
