"""`autoprec.device_clock`: the one clock. CPU paths run for real (sleeps give lower bounds that hold on
a loaded machine); the CUDA paths run against a recording stand-in for ``torch.cuda.Event`` and
``torch.cuda.synchronize``, so where the host syncs is checked on a machine without a GPU."""

import time

import torch

from autoprec import device_clock as timing
from autoprec.costs.inplace import StepTimer
from autoprec.bench.gpu import warm_timing as gpu_timing

CUDA = torch.device("cuda")


# --- the order of interleaved rounds -----------------------------------------------------------


def test_each_round_runs_every_item_once_and_each_item_leads_once_per_cycle():
    items = ["a", "b", "c", "d"]
    orders = [timing.rotated(items, r) for r in range(8)]
    assert all(sorted(order) == items for order in orders)
    assert [order[0] for order in orders] == items * 2 and timing.rotated([], 3) == []


def test_interleaved_keeps_the_timed_rounds_of_each_step_in_rotated_order():
    calls = []

    def step(i):
        def run():
            calls.append(i)
            return float(len(calls))  # its own "seconds": the call's position overall
        return run

    times = timing.interleaved([step(0), step(1), step(2)], warmup=2, repeats=3)
    assert calls == [i for r in range(5) for i in timing.rotated([0, 1, 2], r)]
    assert times == [[float(n + 1) for n in range(6, 15) if calls[n] == i] for i in range(3)]


# --- CPU: wall time ------------------------------------------------------------------------------


def test_timed_returns_the_steps_result_and_at_least_its_sleep():
    out, seconds = timing.timed(lambda: (time.sleep(0.02), "done")[1], torch.device("cpu"))
    assert out == "done" and seconds >= 0.02


def test_cpu_clock_and_median_are_host_wall_time():
    stop = timing.start_clock("cpu")
    time.sleep(0.01)
    assert stop() >= 0.01
    sleeps = [0.001, 0.02, 0.003]
    ms = timing.median_ms(lambda s: time.sleep(s), [(s,) for s in sleeps], repeats=3, device=torch.device("cpu"))
    assert ms >= 3.0  # the median call slept 3 ms


# --- CUDA, against a recording stand-in ----------------------------------------------------------


class FakeCuda:
    """Records, in order, every event record / event wait / device sync and every step run.
    An event's time is the number of log entries before its record (1 entry = 1 ms)."""

    def __init__(self, monkeypatch):
        self.log = []
        fake = self

        class Event:
            def __init__(self, enable_timing=False):
                assert enable_timing, "an event made without timing cannot be read"
                self.at = None

            def record(self):
                self.at = len(fake.log)
                fake.log.append("record")

            def synchronize(self):
                fake.log.append("event wait")

            def elapsed_time(self, end):
                if "sync" not in fake.log[end.at:] and "event wait" not in fake.log[end.at:]:
                    raise RuntimeError("elapsed_time read before the end event completed")
                return float(end.at - self.at)

        monkeypatch.setattr(torch.cuda, "Event", Event)
        monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: self.log.append("sync"))

    def step(self, *args):
        self.log.append("step")


def test_cuda_timed_syncs_before_and_after_the_step(monkeypatch):
    cuda = FakeCuda(monkeypatch)
    timing.timed(cuda.step, CUDA)
    assert cuda.log == ["sync", "step", "sync"]


def test_cuda_median_records_events_around_each_call_and_syncs_only_at_the_ends(monkeypatch):
    cuda = FakeCuda(monkeypatch)
    ms = gpu_timing.median_ms(cuda.step, [(1,), (2,)], repeats=3, device=CUDA)
    assert cuda.log == ["sync"] + ["record", "step", "record"] * 3 + ["sync"]
    assert ms == 2.0  # each call spans its step and the end record: 2 log entries


def test_cuda_stop_waits_on_its_own_event_not_the_device(monkeypatch):
    cuda = FakeCuda(monkeypatch)
    stop = gpu_timing.start_clock(CUDA)
    cuda.step()
    cuda.step()
    assert stop() == 3.0 / 1e3 and cuda.log == ["record", "step", "step", "record", "event wait"]


def test_cuda_warm_up_is_synced_wall_time(monkeypatch):
    cuda = FakeCuda(monkeypatch)
    gpu_timing.warm_up(cuda.step, [(1,), (2,)], calls=3, device=CUDA)
    assert cuda.log == ["sync", "step", "step", "step", "sync"]


def test_cuda_step_timer_marks_layers_with_events_and_syncs_once_per_step(monkeypatch):
    # The in-place timer (the scheduler's and the cost model's) on a CPU model, with its clock
    # switched to CUDA: every layer span and autograd node is an event record, and the host
    # syncs once, in finish(), before any elapsed time is read.
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    timer = StepTimer(model, ["0", "2"])
    timer.clock = timing.Clock(CUDA)
    cuda = FakeCuda(monkeypatch)
    with timer:
        loss = model(torch.randn(3, 4)).sum()
        timer.before_backward(loss)
        loss.backward()
        records = len(cuda.log)
        seconds, _ = timer.finish()
    assert records > 4 and set(cuda.log[:records]) == {"record"} and cuda.log[records:] == ["sync"]
    assert set(seconds) == {"0", "2"} and all(s > 0 for s in seconds.values())

