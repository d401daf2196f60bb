"""CPU-time accounting of a local run (`runtime.profile=True`, `bench.py e2e --profile`).

Where does every CPU-second of the process go? Three sources, combined in `Profiler.report()`:

1. Phases, measured in the thread doing them: `with profile.phase("decode"): ...` reads the
   thread's own CPU clock (time.thread_time), the wall clock, and the thread's run-queue delay
   (/proc/self/task/<tid>/schedstat) at entry and exit. Phases nest; each is charged its exclusive
   time. This is the Python threads' CPU: the interpreter, jax dispatch, numpy, pickling.
2. A sampler thread reads every thread's CPU (/proc/self/task/*/stat, utime+stime) every `tick_s`.
   Threads that are not Python threads are XLA's (its compute and intra-op pools, which run the
   programs a Python thread dispatched): their CPU of each tick is split between the *device*
   phases active at that tick (decode, learner train/log-prob passes, host copies) in proportion
   to each phase's rate in the ticks where it ran alone (`split_native`); with none active it is
   'xla: no phase active'. Python threads outside any
   phase are charged by thread name (relay, publisher, reward pool, dispatcher, ...), and so are
   tensorstore's I/O threads (`ts_pool_worker`: weight-store writes, checkpoints), which are
   native but not XLA's (until this was noticed their CPU was split between the device phases).
3. Child processes (the reward workers): their CPU (utime+stime+cutime+cstime) at start and stop.

GIL wait: inside phases that run Python only (`PY_ONLY`: no device wait, no sleep), wall time minus
the thread's CPU minus its run-queue delay is time the thread was runnable in Python terms but not
running: waiting for the GIL (or for a lock held by a thread that waits for the GIL). It is
measured there only, so it is a lower bound for the whole process.

Errors: /proc clocks tick at 10 ms (per thread, summed over many ticks: about +-10 ms per thread
in total); the split of XLA threads' CPU between concurrent device phases is an estimate (each
phase is assumed to load XLA's threads as much with others active as alone; the report's
`xla_solo` gives each phase's solo ticks and rate, so a rate from few ticks can be judged); a
thread that exits between two ticks loses its last tick's CPU (the process total from
/proc/self/stat does not, so 'unaccounted' shows what was lost).

One profiler is active per process at a time (`start()` installs it, `stop()` removes it): the
phase markers sit in code that does not hold a reference to the run that owns it (rollout workers,
learner passes), and cost one global read when no profiler is active.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from typing import Iterator, Optional, Sequence

_CLK = os.sysconf("SC_CLK_TCK")

# Phases whose XLA-thread CPU is theirs while they are active (they dispatch and wait for programs).
DEVICE_PHASES = ("decode", "learner.train", "learner.logprob", "publish.host_copy", "pull")
# Phases that run Python only (their off-CPU time that is not run-queue delay is GIL or lock wait).
PY_ONLY = ("dispatch",)

# Native threads that are not XLA's: tensorstore's I/O pool (weight-store writes, checkpoints). Their
# CPU is charged to a row by name, not split between the device phases.
IO_THREADS = ("native:ts_pool_worker",)

# The report's rows: (row, phases and thread-name prefixes charged to it).
ROWS = (
    ("decode and prefill", ("decode",)),
    ("learner fwd/bwd + optimizer", ("learner.train",)),  # with the mini-batches' row gathers
    ("log-prob recomputation", ("learner.logprob",)),
    ("learner host work (collate, place, metrics)", ("learner.host",)),
    ("publish (host copy, store write, relay)", ("publish.host_copy", "thread:publish", "thread:relay",
                                                 "thread:weightstore", *IO_THREADS)),
    ("pull, version polls, device transfer", ("pull", "poll")),
    ("rewards", ("thread:reward", "children")),
    ("dispatch and buffer", ("dispatch", "thread:buffer", "thread:scheduler", "thread:health")),
)


def _key(name: str) -> str:
    """A thread name as the report groups it: numbered threads of one kind together."""
    return name.rstrip("0123456789_-v")


def _thread_clocks() -> dict[int, tuple[str, float]]:
    """{tid: (comm, CPU seconds)} of every live thread of this process."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat", "rb") as f:
                raw = f.read().decode("ascii", "replace")
        except OSError:  # exited meanwhile
            continue
        comm = raw[raw.index("(") + 1:raw.rindex(")")]
        fields = raw[raw.rindex(")") + 2:].split()
        out[int(tid)] = (comm, (int(fields[11]) + int(fields[12])) / _CLK)
    return out


def _process_cpu() -> float:
    with open("/proc/self/stat", "rb") as f:
        raw = f.read().decode("ascii", "replace")
    fields = raw[raw.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / _CLK


def _children_cpu() -> float:
    """CPU seconds of this process's child processes (and their waited-for children)."""
    pids: list[str] = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/children") as f:
                pids += f.read().split()
        except OSError:
            continue
    total = 0.0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                raw = f.read().decode("ascii", "replace")
        except OSError:
            continue
        fields = raw[raw.rindex(")") + 2:].split()
        total += sum(int(x) for x in fields[11:15]) / _CLK
    return total


def _run_delay(tid: int) -> float:
    """Seconds this thread has waited on a run queue (runnable, no core free)."""
    try:
        with open(f"/proc/self/task/{tid}/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


def solo_rates(ticks: dict[tuple[tuple[str, int], ...], Sequence[float]]) -> dict[str, tuple[int, float]]:
    """{phase: (its solo ticks, XLA CPU seconds per tick per active instance)} for every phase seen
    running alone (one kind of device phase active), from ticks grouped as in `split_native`."""
    return {active[0][0]: (count, native / active[0][1] / count)
            for active, (native, count) in sorted(ticks.items()) if len(active) == 1 and count}


def split_native(ticks: dict[tuple[tuple[str, int], ...], Sequence[float]]) -> dict[str, float]:
    """XLA threads' CPU charged to device phases, from the sampler's ticks grouped by the device
    phases active (names with instance counts): {active: (XLA CPU summed over those ticks, ticks)}.

    Ticks with one kind of phase active (its *solo* ticks) charge that phase everything and give
    its rate: XLA CPU per tick per active instance. Ticks with several kinds split their CPU in
    proportion to instances x solo rate, so a learner pass, which keeps XLA's pool busy, weighs more
    than a decode step of a small model, which leaves it idle between calls (an equal split per
    instance had charged most of a laminar run's learner passes to decode: the pool's CPU measured
    across the learner's passes was 2-3x what the equal split gave them). A phase never seen alone
    gets the mean of the known non-zero rates (equal shares when none is known). Ticks with no phase
    active go to 'xla: no phase active'.
    """
    rates = {k: rate for k, (_, rate) in solo_rates(ticks).items()}
    known = [r for r in rates.values() if r > 0]
    fallback = sum(known) / len(known) if known else 1.0
    out: dict[str, float] = {}
    for active, (native, _) in ticks.items():
        if not active:
            out["xla: no phase active"] = out.get("xla: no phase active", 0.0) + native
            continue
        weights = {k: n * rates.get(k, fallback) for k, n in active}
        total = sum(weights.values())
        if total <= 0:
            weights, total = {k: float(n) for k, n in active}, float(sum(n for _, n in active))
        for k, w in weights.items():
            out[k] = out.get(k, 0.0) + native * w / total
    return out


class _Acc:
    __slots__ = ("cpu", "wall", "delay", "calls")

    def __init__(self):
        self.cpu = self.wall = self.delay = 0.0
        self.calls = 0


class Profiler:
    def __init__(self, tick_s: float = 0.05):
        self.tick_s = tick_s
        self._lock = threading.Lock()
        self._phases: dict[str, _Acc] = {}
        self._active: dict[str, int] = {}  # device phase -> instances active now
        # Sampler ticks by the device phases active (name, instances): [XLA CPU summed, ticks]
        self._ticks: dict[tuple[tuple[str, int], ...], list] = {}
        self._threads: dict[int, tuple[str, float]] = {}  # tid -> (name, CPU seconds at the last tick)
        # CPU seconds in the window by thread name, summed from the same per-tick deltas the ticks
        # split (a thread's name can change: a native thread is 'python' until it names itself).
        self._by_name: dict[str, float] = {}
        self._local = threading.local()
        self._stop = threading.Event()
        self._sampler: Optional[threading.Thread] = None
        self.t0 = self.t1 = 0.0
        self.cpu0 = self.cpu1 = self.children0 = self.children1 = 0.0

    # ------------------------------------------------------------------ phases (any thread)
    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
            self._local.tid = threading.get_native_id()
        now = self._clocks(name)
        if stack:
            self._charge(stack[-1], now)
        stack.append([name, *now])
        if name in DEVICE_PHASES:
            with self._lock:
                self._active[name] = self._active.get(name, 0) + 1
        try:
            yield
        finally:
            top = stack.pop()
            now = self._clocks(name)
            self._charge(top, now, done=True)
            if stack:
                stack[-1][1:] = now  # the parent resumes now
            if name in DEVICE_PHASES:
                with self._lock:
                    self._active[name] -= 1

    def _clocks(self, name: str) -> list[float]:
        delay = _run_delay(self._local.tid) if name in PY_ONLY else 0.0
        return [time.thread_time(), time.perf_counter(), delay]

    def _charge(self, entry: list, now: list[float], done: bool = False) -> None:
        name, cpu, wall, delay = entry
        with self._lock:
            acc = self._phases.get(name) or self._phases.setdefault(name, _Acc())
            acc.cpu += now[0] - cpu
            acc.wall += now[1] - wall
            acc.delay += now[2] - delay if name in PY_ONLY else 0.0
            acc.calls += done

    # ------------------------------------------------------------------ sampler
    def start(self) -> "Profiler":
        global _ACTIVE
        if _ACTIVE is not None:
            raise RuntimeError("a profiler is already active in this process")
        self.t0, self.cpu0, self.children0 = time.perf_counter(), _process_cpu(), _children_cpu()
        self._threads = self._named(_thread_clocks())
        self._by_name = {}
        _ACTIVE = self
        self._sampler = threading.Thread(target=self._run, name="profile-sampler", daemon=True)
        self._sampler.start()
        return self

    def stop(self) -> None:
        global _ACTIVE
        self._stop.set()
        if self._sampler is not None:
            self._sampler.join(timeout=5.0)
        self._tick()
        self.t1, self.cpu1, self.children1 = time.perf_counter(), _process_cpu(), _children_cpu()
        if _ACTIVE is self:
            _ACTIVE = None

    def _named(self, clocks: dict[int, tuple[str, float]]) -> dict[int, tuple[str, float]]:
        """Python threads by their threading name; the others (XLA's) as 'native:<comm>'. A thread
        once seen as a Python thread keeps its name: one that has left threading's registry is
        exiting, not native (the sampler itself, at stop(), had its CPU charged to XLA)."""
        py = {t.native_id: t.name for t in threading.enumerate()}
        out = {}
        for tid, (comm, cpu) in clocks.items():
            prev = self._threads.get(tid)
            if tid in py:
                out[tid] = (f"thread:{py[tid]}", cpu)
            elif prev is not None and prev[0].startswith("thread:") and cpu >= prev[1]:
                out[tid] = (prev[0], cpu)
            else:
                out[tid] = (f"native:{comm}", cpu)
        return out

    def _run(self) -> None:
        while not self._stop.wait(self.tick_s):
            self._tick()

    def _tick(self) -> None:
        now = self._named(_thread_clocks())
        native = 0.0
        for tid, (name, cpu) in now.items():
            prev = self._threads.get(tid)
            # A thread started after start() (or a reused tid: its clock went back) has all its CPU
            # in the window, and in this tick (its phases are the ones active now).
            delta = cpu - prev[1] if prev is not None and cpu >= prev[1] else cpu
            self._by_name[name] = self._by_name.get(name, 0.0) + delta
            if name.startswith("native:") and _key(name) not in IO_THREADS:
                native += delta
        self._threads.update(now)
        if native <= 0:
            return
        with self._lock:
            active = tuple(sorted((k, n) for k, n in self._active.items() if n > 0))
            acc = self._ticks.setdefault(active, [0.0, 0])
            acc[0] += native
            acc[1] += 1

    # ------------------------------------------------------------------ the report
    def thread_cpu(self) -> dict[str, float]:
        """CPU seconds in the window by thread name (threads of one name summed; digits dropped)."""
        out: dict[str, float] = {}
        for name, cpu in self._by_name.items():
            out[_key(name)] = out.get(_key(name), 0.0) + cpu
        return out

    def report(self, trained_tokens: int, generated_tokens: int = 0) -> dict:
        """The `profile` block of the summary (seconds, shares of process CPU, CPU-ms per 1k trained tokens)."""
        wall = max(self.t1 - self.t0, 1e-9)
        with self._lock:
            ticks = {k: tuple(v) for k, v in self._ticks.items()}
        native = split_native(ticks)  # XLA threads' CPU by the phase it is charged to
        process = self.cpu1 - self.cpu0
        children = max(self.children1 - self.children0, 0.0)
        by_thread = self.thread_cpu()
        phase_py = {k: a.cpu for k, a in self._phases.items()}
        # Python threads' CPU outside phases: the thread's total minus its phases' CPU (by thread name;
        # phase-marked threads are the rollout servers and the learner's).
        marked = sum(phase_py.values())
        unmarked = {k: v for k, v in by_thread.items() if k.startswith("thread:")}
        io = {k: v for k, v in by_thread.items() if k in IO_THREADS}
        native_total = sum(v for k, v in by_thread.items() if k.startswith("native:") and k not in io)
        rows, used = [], set()
        for row, keys in ROWS:
            py = sum(phase_py.get(k, 0.0) for k in keys)
            py += sum(v for t, v in unmarked.items() for k in keys if k.startswith("thread:") and t.startswith(k))
            used |= {t for t in unmarked for k in keys if k.startswith("thread:") and t.startswith(k)}
            xla = sum(native.get(k, 0.0) for k in keys)
            child = children if "children" in keys else 0.0
            rows.append(self._row(row, py, xla + child, wall, trained_tokens, sum(io.get(k, 0.0) for k in keys)))
        xla_idle = native.get("xla: no phase active", 0.0)
        rows.append(self._row("xla: no phase active", 0.0, xla_idle, wall, trained_tokens))
        # Phase-marked threads (servers, learner) outside their phases, and other Python threads.
        sampler = unmarked.get("thread:profile-sampler", 0.0)
        marked_threads = sum(v for t, v in unmarked.items() if t not in used) - sampler
        rows.append(self._row("other Python (loops, idle polling, unmarked)", max(marked_threads - marked, 0.0), 0.0,
                              wall, trained_tokens))
        rows.append(self._row("the profiler's sampler thread", sampler, 0.0, wall, trained_tokens))
        accounted = sum(r["cpu_s"] for r in rows) - children
        rows.append(self._row("unaccounted (exited threads, clock ticks)", process - accounted, 0.0, wall,
                              trained_tokens))
        gil = sum(max(a.wall - a.cpu - a.delay, 0.0) for k, a in self._phases.items() if k in PY_ONLY)
        delay = sum(a.delay for k, a in self._phases.items() if k in PY_ONLY)
        py_total = sum(v for k, v in by_thread.items() if k.startswith("thread:"))
        total = process + children
        for r in rows:
            r["share"] = round(r["cpu_s"] / total, 4) if total > 0 else None
        return {
            "wall_s": round(wall, 2), "process_cpu_s": round(process, 2), "children_cpu_s": round(children, 2),
            "cores_busy": round(total / wall, 3), "trained_tokens": trained_tokens, "generated_tokens": generated_tokens,
            "cpu_ms_per_1k_trained_tokens": round(1e6 * total / max(trained_tokens, 1), 1),
            "python_threads_cpu_s": round(py_total, 2), "xla_threads_cpu_s": round(native_total, 2),
            "io_threads_cpu_s": round(sum(io.values()), 2),
            "python_share": round(py_total / process, 4) if process > 0 else None,
            "gil_wait_s": round(gil, 2), "run_queue_wait_s": round(delay, 2),
            "gil_wait_in": list(PY_ONLY),
            "xla_solo": {k: {"ticks": n, "xla_ms_per_tick": round(1e3 * rate, 2)} for k, (n, rate) in solo_rates(ticks).items()},
            "rows": rows,
            "phases": {k: {"cpu_s": round(a.cpu, 3), "wall_s": round(a.wall, 3), "calls": a.calls,
                           "xla_cpu_s": round(native.get(k, 0.0), 3)} for k, a in sorted(self._phases.items())},
            "threads": {k: round(v, 2) for k, v in sorted(by_thread.items(), key=lambda kv: -kv[1]) if v >= 0.01},
        }

    @staticmethod
    def _row(name: str, python_s: float, xla_s: float, wall: float, tokens: int, io_s: float = 0.0) -> dict:
        """io_s: tensorstore's I/O threads (IO_THREADS), neither Python nor XLA."""
        cpu = python_s + xla_s + io_s
        return {"row": name, "cpu_s": round(cpu, 3), "python_s": round(python_s, 3), "xla_s": round(xla_s, 3),
                "io_s": round(io_s, 3), "cores": round(cpu / wall, 3),
                "cpu_ms_per_1k_tokens": round(1e6 * cpu / max(tokens, 1), 1)}


_ACTIVE: Optional[Profiler] = None
_NULL = contextlib.nullcontext()


def phase(name: str):
    """A phase of the active profiler, or a no-op context when none is active."""
    p = _ACTIVE
    return _NULL if p is None else p.phase(name)


def active() -> Optional[Profiler]:
    return _ACTIVE


def instrument_learner(learner) -> None:
    """Time the learner's log-prob pass and its updates (with the mini-batches' row gathers) as phases of
    their own. Each waits for its result inside the phase (profile runs only): with jax's
    asynchronous dispatch the pass would otherwise end before its program ran, and its XLA CPU
    would land on whatever phase came next."""
    import jax

    def timed(fn, name):
        def call(*args, **kwargs):
            with phase(name):
                return jax.block_until_ready(fn(*args, **kwargs))
        return call

    learner._prepare = timed(learner._prepare, "learner.logprob")
    learner._train_step = timed(learner._train_step, "learner.train")  # one update over the whole batch
    learner._updates = timed(learner._updates, "learner.train")  # a step's updates with their row gathers
