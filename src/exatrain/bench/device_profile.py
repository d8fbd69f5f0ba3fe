"""`exatrain bench device --profile`: why a path is as fast as it is, from one torch.profiler
window per case and path.

For the steps of the window (`--profile-steps`, after the warm-up):

  top kernels        the 15 operators with the most device time (self time on a CPU), written
                     as a table to `<json>-profile-<case>-<variant>.txt`
  host syncs / step  the waits of the host for the device: CUDA runtime `*Synchronize` calls on
                     a GPU; on a CPU, where nothing waits, the reads of a tensor's value into
                     Python on the training thread (`observe.host_reads`), each of which
                     would be a wait on a GPU (what a read point reads after the window's last
                     step is not counted: the window measures the steps between read points)
  compiled share     the share of that time spent in code torch.compile generated (Triton
                     kernels on a GPU; compiled regions on a CPU)

`Window` is handed to the Trainer's observer (its `profiler`, stepped after each step) and to
the plain loop (stepped by it), so the same steps are profiled the same way in both.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..observe.host_reads import HostReads

SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


class Window:
    """A torch.profiler over `steps` steps after `skip` (call `step()` after every step)."""

    def __init__(self, device: torch.device, skip: int, steps: int):
        self.cuda = torch.device(device).type == "cuda"
        self.steps = steps
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.profiler = torch.profiler.profile(
            activities=activities, schedule=torch.profiler.schedule(
                wait=max(0, skip - 1), warmup=1 if skip else 0, active=steps, repeat=1))
        self.profiler.start()
        self.skip, self.done = skip, 0
        self.reads = None if self.cuda else HostReads(lambda: self.done)
        if self.reads is not None and skip == 0:
            self.reads.__enter__()

    # the observer's interface (observe.observer): step() and stop()
    def step(self) -> None:
        self.profiler.step()
        self.done += 1
        if self.reads is not None and self.done == self.skip:
            self.reads.__enter__()   # counting from the first profiled step on

    def stop(self) -> None:
        self.profiler.stop()
        if self.reads is not None and self.done >= self.skip:
            self.reads.__exit__(None, None, None)

    def figures(self) -> tuple[dict, str]:
        """(host_syncs_per_step, compiled_share) and the top-kernels table."""
        events = self.profiler.key_averages()
        if self.cuda:
            syncs = sum(e.count for e in events if e.key in SYNC_CALLS)
            timed = [e for e in events if e.self_device_time_total > 0]
            total = sum(e.self_device_time_total for e in timed) or 1.0
            compiled = sum(e.self_device_time_total for e in timed if e.key.startswith("triton_"))
            sort = "self_device_time_total"
        else:
            syncs = self.reads.on_steps(range(self.skip, self.skip + self.steps))
            total = sum(e.self_cpu_time_total for e in events if not e.key.startswith("ProfilerStep")) or 1.0
            # compiled graphs' forward and backward (CompiledFunction, CompiledFunctionBackward)
            compiled = sum(e.cpu_time_total for e in events if e.key.startswith("CompiledFunction"))
            sort = "self_cpu_time_total"
        table = events.table(sort_by=sort, row_limit=15, max_name_column_width=60)
        return {"host_syncs_per_step": syncs / self.steps,
                "compiled_share": min(1.0, compiled / total)}, table


def write_table(json_path: str, case: str, variant: str, table: str) -> str:
    """The table beside the bench's JSON (or in the working directory); returns its path."""
    stem = Path(json_path).with_suffix("") if json_path else Path("bench-device")
    path = Path(f"{stem}-profile-{case}-{variant}.txt")
    path.write_text(table)
    return str(path)


__all__ = ["Window", "write_table"]
