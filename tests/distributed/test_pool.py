"""distributed/pool.py on a simulated Ray (no cluster): items go to whichever built actor is free, each actor is
built once, a dead worker's item runs again elsewhere once, a second death or a task's own error ends the run,
and the actors still busy are killed. The simulation keeps a clock: a call finishes ``cost`` time units after
its actor is free, and ``ray.wait`` returns the earliest finished reference (ties: the earliest made)."""

from __future__ import annotations

import itertools

import pytest

pytest.importorskip("ray")
from ray.exceptions import RayActorError  # noqa: E402

from kvsieve.distributed import pool as pool_module  # noqa: E402
from kvsieve.distributed.pool import WorkerLost, WorkerPool  # noqa: E402


class Die(Exception):
    """Raised inside a simulated actor: its process dies (Ray then fails its calls with RayActorError)."""


class Ref:
    _seq = itertools.count()

    def __init__(self, actor: Actor, call, ready_at: float) -> None:
        self.actor, self.call, self.ready_at, self.seq = actor, call, ready_at, next(self._seq)
        self.done, self.value, self.error = False, None, None

    def resolve(self):
        if not self.done:
            self.done = True
            if self.actor.dead:
                self.error = RayActorError()
            else:
                try:
                    self.value = self.call()
                except Die:
                    self.actor.dead = True
                    self.error = RayActorError()
                except Exception as err:  # the task's own error, as Ray re-raises it
                    self.error = err
        if self.error is not None:
            raise self.error
        return self.value


class Actor:
    """A simulated actor process around an instance of the user's class, built when first asked (``pid``)."""

    def __init__(self, ray: FakeRay, cls, args) -> None:
        self.ray, self.dead, self.free_at, self.instance = ray, False, ray.now, None
        self.cls, self.args = cls, args

    def build(self):
        self.instance = self.cls(*self.args)
        return self.instance.pid()

    def __getattr__(self, method: str):
        actor = self

        class Method:
            @staticmethod
            def remote(*args):
                if method == "pid":
                    return Ref(actor, actor.build, actor.ray.now)
                cost = abs(float(args[0])) if args and isinstance(args[0], (int, float)) else 1.0
                start = max(actor.ray.now, actor.free_at)
                actor.free_at = start + cost
                return Ref(actor, lambda: getattr(actor.instance, method)(*args), start + cost)

        return Method


class FakeRay:
    def __init__(self) -> None:
        self.now, self.killed, self.options = 0.0, [], None

    def remote(self, **options):
        self.options = options

        def wrap(cls):
            ray = self

            class Remote:
                @staticmethod
                def remote(*args):
                    return Actor(ray, cls, args)

            return Remote

        return wrap

    def wait(self, refs, num_returns=1):
        first = min(refs, key=lambda r: (r.ready_at, r.seq))
        self.now = max(self.now, first.ready_at)
        return [first], [r for r in refs if r is not first]

    def get(self, ref):
        return ref.resolve()

    def kill(self, handle, no_restart=True):
        handle.dead = True
        self.killed.append(handle)


class Squarer:
    """The user's actor: ``evaluate(x)`` returns x * x; ``deaths[x]`` times its process dies on item x first;
    x < 0 raises the task's own error. Counts how many were built."""

    pids = itertools.count(100)
    built: list[int] = []
    deaths: dict[float, int] = {}
    fail_builds = 0

    def __init__(self, tag: str) -> None:
        if Squarer.fail_builds:
            Squarer.fail_builds -= 1
            raise Die("out of memory while loading")
        self.tag, self._pid, self.done = tag, next(Squarer.pids), []
        Squarer.built.append(self._pid)

    def pid(self) -> int:
        return self._pid

    def evaluate(self, x: float) -> tuple[float, int]:
        if Squarer.deaths.get(x, 0):
            Squarer.deaths[x] -= 1
            raise Die
        if x < 0:
            raise KeyError(f"item {x}")
        return x * x, self._pid


@pytest.fixture
def ray(monkeypatch):
    fake = FakeRay()
    monkeypatch.setattr(pool_module, "import_ray", lambda: fake)
    Squarer.built, Squarer.deaths, Squarer.fail_builds = [], {}, 0
    return fake


def run(pool: WorkerPool, items: list[float]) -> tuple[list[tuple[int, tuple]], list[tuple[int, int]]]:
    done, dispatched = [], []
    pool.run("evaluate", [(x,) for x in items], lambda i, r: done.append((i, r)),
             on_dispatch=lambda pid, i: dispatched.append((pid, i)), describe=lambda i: f"item {i}")
    return done, dispatched


def test_items_go_to_the_free_actor_and_each_actor_is_built_once(ray):
    pool = WorkerPool(Squarer, ("t",), cpus_per_worker=2)
    assert ray.options == {"num_cpus": 2, "max_restarts": 0, "max_task_retries": 0}
    with pytest.raises(ValueError, match="no workers: call grow"):
        run(pool, [1.0])
    pool.grow(2)
    a, b = pool.pids()
    # item 0 takes 5 units; the other worker finishes items 1-5 (1 unit each) meanwhile, then item 6 goes first free
    items = [5.0, 1.0, 1.0, 1.0, 1.0, 1.0, 2.0]
    done, dispatched = run(pool, items)
    assert sorted(i for i, _ in done) == list(range(7)) and all(r[0] == items[i] ** 2 for i, r in done)
    assert [i for i, _ in done] == [1, 2, 3, 4, 0, 5, 6]  # finishing order: 1,2,3,4 at t=1..4, 0 and 5 at t=5
    assert [pid for pid, i in dispatched if i != 6].count(a) == 1 and dict((i, p) for p, i in dispatched)[0] == a
    assert Squarer.built == [a, b]  # built once, however many items
    pool.grow(2)  # already two: nothing new
    assert len(Squarer.built) == 2
    run(pool, [1.0, 1.0])
    assert len(Squarer.built) == 2 and not ray.killed


def test_a_dead_worker_is_replaced_and_its_item_retried_once_elsewhere(ray, capsys):
    pool = WorkerPool(Squarer, ("t",))
    pool.grow(2)
    a, b = pool.pids()
    Squarer.deaths = {3.0: 1}
    items = [1.0, 3.0, 1.0, 1.0]
    done, dispatched = run(pool, items)
    assert sorted(i for i, _ in done) == [0, 1, 2, 3]  # each item's result once, item 1 among them
    dead = dict((i, p) for p, i in dispatched[:2])[1]
    assert pool.retried == [(1, dead)] and pool.replaced == 1
    assert [w.pid() for w in pool.workers if w.pid() == dead] == [] and len(pool.workers) == 2
    assert len(Squarer.built) == 3 and ray.killed[0].dead
    assert [p for p, i in dispatched if i == 1][1] != dead  # the retry ran on a live worker
    assert f"pid {dead}) died (RayActorError); retrying item 1 on another worker" in capsys.readouterr().err


def test_an_item_whose_worker_dies_twice_ends_the_run(ray):
    pool = WorkerPool(Squarer, ("t",), max_retries=1)
    pool.grow(2)
    Squarer.deaths = {3.0: 2}
    with pytest.raises(WorkerLost, match=r"item 1: its worker died 2 times \(RayActorError"):
        run(pool, [1.0, 3.0, 1.0])
    assert pool.retried[0][0] == 1 and pool.replaced == 2


def test_a_tasks_own_error_is_not_retried_and_busy_actors_are_killed(ray):
    pool = WorkerPool(Squarer, ("t",))
    pool.grow(2)
    done = []
    with pytest.raises(KeyError, match="item -1"):
        # item 0 (-1) fails at t=1 while the other worker is still on item 1 (9 units)
        pool.run("evaluate", [(-1.0,), (9.0,)], lambda i, r: done.append(i))
    assert done == [] and pool.retried == [] and pool.replaced == 0
    assert len(ray.killed) == 1 and len(pool.workers) == 1  # the busy actor was killed, the idle one stays
    assert ray.killed[0].dead and not pool.workers[0].handle.dead
    done, _ = run(pool, [2.0])  # a later run starts from the idle worker
    assert done == [(0, (4.0, pool.workers[0].pid()))]


def test_a_worker_dying_while_built_is_replaced(ray, capsys):
    Squarer.fail_builds = 1
    pool = WorkerPool(Squarer, ("t",))
    pool.grow(2)
    done, _ = run(pool, [1.0, 1.0, 1.0])
    assert sorted(i for i, _ in done) == [0, 1, 2] and pool.replaced == 1 and len(Squarer.built) == 2
    assert "a worker died while it was built (RayActorError" in capsys.readouterr().err
