"""Greedy list scheduling of F, B and W under a memory cap: the machinery of `zbv`,
`seq1f1b-zbv` and the searched `seq1f1b-zb-auto`.

Where zero_bubble.py keeps a base program's F/B order and only places W, this places all three:
it replays every rank at once in time (each action lasts what `costs` says) and, whenever a rank
is free, starts the first of these that can run now (`Policy` orders the first two):
1. a backward unit whose dependencies have finished, oldest micro-batch first (B is on the
   critical path: the previous stage waits for its input grad);
2. a forward unit, the later model chunk first (in a V, chunk 1 leads to the loss and so to the
   next backward), if the rank has room for it;
3. its oldest owed W unit (weight grads nobody waits for fill what would be idle time, and free
   the span's activations);
otherwise it waits for the next action to finish anywhere. With `Policy.wait_for_backward` a
forward is left for later when a backward of the rank will be ready before the forward would end
(the backward is what the rest of the pipeline waits for; at P = 16, m = 16 under skewed costs
this is the difference between 63.5 and CP-SAT's optimum, 62.75).

Memory follows the simulator's rules (`simulate.held_change`): F allocates the span's activations
(and the micro-batch's whole K/V at span 0), the micro-batch's first B its dK/dV accumulators, W
frees the activations and B(i,0) the K/V. A forward that *admits* work onto a rank (any forward,
except chunk 1 of a V, whose work came in through chunk 0) runs only if the rank's held bytes,
plus what earlier admissions promised, plus its own bytes and promises stay within `cap`; it
promises what it will make the rank allocate without asking: its twin on chunk 1 of a V and the
dK/dV accumulators. So every rank stays within the cap, and admitted work can always travel on
and come back as backward (with a cap that holds a micro-batch and no depth limit, the oldest
micro-batch can always move; the grid tests check it, a proof is not written down).

Keeping every promise at once is safe but dear: on rank 0 of a V each admitted micro-batch keeps
room for its chunk-1 twin, the loss's stage and its logits, though those run and are freed one
micro-batch at a time; 1% under ZB-V's peak the V search gave 7.29 s against 5.57 s at it (7B,
P = 8, m = 16, k = 1; 5.87 s with what follows). With `Policy.promises = "in turn"` the rank
keeps room in turn, as the banker's algorithm does: an allocation (an admission, a promised twin
or accumulator) goes ahead only if the micro-batches holding or promised bytes on the rank could
then finish one after another, oldest first, each getting what it was promised from what is
free plus what the older ones held. The oldest micro-batch's allocations always pass, so it can
always move on every rank; a replay that still gets stuck is refused like any other.

With `Policy.promises = "none"` the rank keeps no room at all: every allocation (an admission, a
twin, the accumulators) waits only until it fits beside what the rank holds now. That risks a
replay where every rank waits for room that nothing will free (refused, like any stuck one), but
where it goes through it holds the cap as tightly as an exact solver does: at 7B, P = 4, m = 4,
k = 2 on a V under Seq1F1B's peak its replays were 2.90 s against 3.08 s for the others, and the
search ended at 2.744 s against 2.920 s (2.709 s with the depth search from more replays,
zero_bubble_v.py; CP-SAT's best order in 300 s: 2.651 s).

With the output layer spread (`Problem.spread_output`: O actions, actions.OPS) an O is no
rank's own: a rank that is free takes the oldest ready O before anything else (the last stage's
B waits for it) if its work stays within an even share of all the work plus `Policy.output_slack`
O's and the O's bytes fit beside what it holds; the last stage's rank takes one beyond that only
when no other rank could. With `output_slack` None only the last stage's rank takes them.

Warm-up depths, how far W trails B and how the two chunks of a V interleave are consequences of
the costs and the cap, not typed in. The dependency rules are `actions.dependencies`, asked once per action shape.

A cap too small for any order (every rank blocked, nothing owed) raises ScheduleError. The result
is a valid program under any costs (the replay executed it); the costs only chose it, and the
replay's timing is the simulator's (tested).
"""
from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass
from typing import Optional

from seq1f1b.plan.actions import Action, Schedule, ScheduleError, dependencies
from seq1f1b.plan.simulate import SpanCosts, Table, held_change, held_rise, held_tables


@dataclass(frozen=True)
class Problem:
    """The shape of a schedule to build: P ranks, m micro-batches, k spans, V chunks placed by
    `placement`; `unit` spans alternate as one unit (1: single spans, k: whole micro-batches)."""

    pp: int
    microbatches: int
    splits: int
    chunks: int
    placement: str = "loop"
    unit: int = 1
    spread_output: bool = False   # the output layer as O actions any rank may run (actions.OPS)

    def shape(self) -> Schedule:
        """A schedule of this shape without programs (stage_of, owner_of, dependencies)."""
        return Schedule("shape", self.pp, self.microbatches, self.splits, self.chunks,
                        ((),) * self.pp, self.placement)


def unit_costs(problem: Problem) -> SpanCosts:
    """F = B = W = 1 per span and chunk; a span holds 1/V of a unit of memory on a chunk (a chunk
    has 1/V of a rank's layers), no K/V: 1F1B's rank 0 then peaks at P*k units."""
    def table(value: float) -> Table:
        return tuple((value,) * problem.splits for _ in range(problem.pp * problem.chunks))

    zero = table(0.0)
    return SpanCosts(table(1.0), table(1.0), table(1.0), activation_bytes=table(1.0 / problem.chunks),
                     kv_cache_bytes=zero, logits_bytes=zero, kv_accumulator_bytes=zero)


Steps = tuple[int, ...]


class _Rank:
    """One rank's state during a replay."""

    def __init__(self, forwards: list[deque[Steps]], backwards: list[deque[Steps]],
                 depth: float) -> None:
        self.forwards = forwards        # per chunk: F units still to run, in order
        self.backwards = backwards      # per chunk: B units still to run, in order
        self.depth = depth              # most spans whose F ran and B did not, per chunk
        self.owed: deque[Steps] = deque()      # W units whose B has run
        self.current: deque[int] = deque()     # steps of the unit being run
        self.held = 0.0
        self.reserved = 0.0     # promised to allocations that admitted forwards will cause
        self.in_flight = 0      # spans whose F ran and B did not, over both chunks
        self.program: list[int] = []
        self.held_by: dict[int, float] = {}    # micro-batch -> bytes it holds here
        self.claims: dict[int, float] = {}     # micro-batch -> bytes promised to it here

    def done(self) -> bool:
        return not (self.current or self.owed or any(self.forwards) or any(self.backwards))


_OPS = ("F", "B", "W")


class _Plan:
    """Every (rank, action) as an integer step, with its dependencies, duration and bytes.

    Step id = ((((rank * V + chunk) * 3 + op) * k + span) * m + microbatch): the rules tie actions
    of one micro-batch alike for every micro-batch, so each (rank, chunk, op, span) asks
    `dependencies` once and shifts the answer by the micro-batch. With the output layer spread,
    O(i, j) follows as step `outputs + j * m + i`, whichever rank runs it: it needs the last
    stage's F(i, j), and that stage's B(i, j) needs it."""

    def __init__(self, problem: Problem, costs: SpanCosts) -> None:
        shape = problem.shape()
        tables = held_tables(costs)
        if tables is None:
            raise ScheduleError("a memory-capped schedule needs the bytes of every span")
        self.problem = problem
        m, k, V = problem.microbatches, problem.splits, problem.chunks
        self.duration: list[float] = []
        self.alloc: list[float] = []
        self.release: list[float] = []
        self.needs: list[tuple[int, ...]] = []
        for rank in range(problem.pp):
            for chunk in range(V):
                stage = shape.stage_of(rank, chunk)
                for op in _OPS:
                    for j in range(k):
                        probe = Action(op, 0, j, chunk)
                        rise, release = held_rise(held_change(tables, stage, probe,
                                                              op == "W"))
                        values = (costs.duration(stage, probe), rise, release)
                        bases = [self.step(r, d.chunk, d.op, d.span, 0)
                                 for r, d in dependencies(shape, rank, probe)]
                        for i in range(m):
                            self.duration.append(values[0])
                            self.alloc.append(values[1])
                            self.release.append(values[2])
                            self.needs.append(tuple(base + i for base in bases))
        self.outputs = len(self.duration)
        if problem.spread_output:
            last_rank, last_chunk = shape.owner_of(shape.num_stages - 1)
            for j in range(k):
                probe = Action("O", 0, j)
                rise, release = held_rise(held_change(tables, 0, probe, False))
                for i in range(m):
                    self.duration.append(costs.duration(0, probe))
                    self.alloc.append(rise)
                    self.release.append(release)
                    self.needs.append((self.step(last_rank, last_chunk, "F", j, i),))
                    backward = self.step(last_rank, last_chunk, "B", j, i)
                    self.needs[backward] += (self.outputs + j * m + i,)
        self.finished = [math.inf] * len(self.duration)
        self._actions: Optional[list[Action]] = None

    def step(self, rank: int, chunk: int, op: str, span: int, microbatch: int) -> int:
        p = self.problem
        if op == "O":       # whichever rank runs it
            return self.outputs + span * p.microbatches + microbatch
        return ((((rank * p.chunks + chunk) * 3 + _OPS.index(op)) * p.splits + span)
                * p.microbatches + microbatch)

    def action(self, step: int) -> Action:
        return self.actions()[step]

    def actions(self) -> list[Action]:
        """The action of every step, made once: each replay returns its programs as actions,
        and a search makes hundreds of replays."""
        if self._actions is not None:
            return self._actions
        p, actions = self.problem, []
        for step in range(self.outputs):
            rest, i = divmod(step, p.microbatches)
            rest, j = divmod(rest, p.splits)
            rest, op = divmod(rest, 3)
            actions.append(Action(_OPS[op], i, j, rest % p.chunks))
        for step in range(len(self.duration) - self.outputs):
            j, i = divmod(step, p.microbatches)
            actions.append(Action("O", i, j))
        self._actions = actions
        return actions

    def op(self, step: int) -> str:
        p = self.problem
        if step >= self.outputs:
            return "O"
        return _OPS[step // (p.microbatches * p.splits) % 3]

    def microbatch(self, step: int) -> int:
        return step % self.problem.microbatches

    def ready_at(self, step: int) -> float:
        """When every dependency of `step` has finished (inf while one is not placed)."""
        # A loop, not max() over a list: the replay asks this millions of times (end times are
        # >= 0, so 0.0 is what max(..., default=0.0) gave).
        finished, latest = self.finished, 0.0
        for need in self.needs[step]:
            if finished[need] > latest:
                latest = finished[need]
        return latest


def _units(steps: list[int], size: int) -> deque:
    return deque(tuple(steps[n:n + size]) for n in range(0, len(steps), size))


PROMISES = ("at once", "in turn", "none")
"""The ways a replay keeps room for what admitted forwards will allocate later (Policy)."""


@dataclass(frozen=True)
class Policy:
    """The knobs of the greedy replay: `forward_first` tries a forward before a ready backward
    (1F1B's alternation keeps the pipeline fed) instead of after it; `depth[r]` caps the spans
    rank r holds between their F and their B (None: only memory caps them);
    `wait_for_backward` idles the rank rather than start a forward that a backward of the rank,
    due before that forward would end, would have to wait for; `promises` says how room is kept
    for what admitted forwards will allocate later (module doc): "at once" (for every admitted
    micro-batch together), "in turn" (for one after another, oldest first) or "none" (only
    what an action allocates when it starts must fit); with the output layer spread
    (Problem.spread_output) `output_slack` says how much work, in O's, beyond an even share of
    all the work a rank may hold and still take an O (module doc), and None that only the last
    stage's rank takes them, each as soon as it is ready (the layer's work where Megatron puts
    it, its bytes held only while the O runs)."""

    forward_first: bool = True
    depth: Optional[tuple[int, ...]] = None
    later_forward_first: bool = True     # among ready forwards, the later chunk's first
    later_backward_first: bool = True    # among ready backwards of one micro-batch, likewise
    wait_for_backward: bool = False      # leave a forward for a backward due before it ends
    promises: str = "at once"            # one of PROMISES
    output_slack: Optional[float] = 1.0  # O's beyond an even share a rank may take; None:
                                         # O's on the last stage's rank alone

    def __post_init__(self) -> None:
        if self.promises not in PROMISES:
            raise ValueError(f"Policy.promises must be one of {PROMISES}, got {self.promises!r}")


@dataclass
class Placed:
    """What a replay placed: each rank's program and when its last action ends (the replay's
    timing is the simulator's: an action starts once its rank and its dependencies are done)."""

    programs: list[list[Action]]
    makespan: float
    held_back: bool = False     # a forward waited for room that promises kept (all at once)


class Placer:
    """Greedy replays of one problem under one cost table (the step graph is built once and
    reused by every policy a search tries)."""

    def __init__(self, problem: Problem, costs: SpanCosts) -> None:
        self.problem = problem
        self.plan = _Plan(problem, costs)
        self.promise, self.promised = _promises(self.plan, problem)
        # What the O hand-off reads, the same for every replay: the O steps oldest first, each
        # rank's own work, an even share of all the work, the longest O, the last stage's rank
        plan = self.plan
        self.outputs = sorted(range(plan.outputs, len(plan.duration)), key=plan.microbatch)
        # the sums start at 0.0, not 0: the same floats, and typed float where mypyc compiles
        self.work = [sum(plan.duration[rank * (plan.outputs // problem.pp):
                                       (rank + 1) * (plan.outputs // problem.pp)], 0.0)
                     for rank in range(problem.pp)]
        self.share = (sum(self.work, 0.0) + sum((plan.duration[s] for s in self.outputs), 0.0)
                      ) / problem.pp
        self.longest_output = max((plan.duration[s] for s in self.outputs), default=0.0)
        self.home = problem.shape().owner_of(problem.pp * problem.chunks - 1)[0]

    def place(self, cap: float, policy: Policy = Policy()) -> Placed:
        """Per-rank programs of F, B and W placed by the greedy replay (module docstring) with
        every rank's held bytes at most `cap`; ScheduleError when no order fits."""
        return _Replay(self, cap, policy).run()


class _Replay:
    """One greedy replay: the state of every rank and of the O hand-off, and the choices
    (module docstring). A class of typed fields and methods, not closures, so that mypyc
    compiles it (compiled.py)."""

    def __init__(self, placer: Placer, cap: float, policy: Policy) -> None:
        problem, plan = placer.problem, placer.plan
        plan.finished = [math.inf] * len(plan.duration)
        m, k, V = problem.microbatches, problem.splits, problem.chunks
        self.problem, self.plan, self.policy, self.cap = problem, plan, policy, cap
        self.promise, self.promised = placer.promise, placer.promised
        self.size = problem.unit
        self.ranks: list[_Rank] = []
        for rank in range(problem.pp):
            forwards = [_units([plan.step(rank, c, "F", j, i) for i in range(m)
                                for j in range(k)], self.size) for c in range(V)]
            backwards = [_units([plan.step(rank, c, "B", j, i) for i in range(m)
                                 for j in reversed(range(k))], self.size) for c in range(V)]
            self.ranks.append(_Rank(forwards, backwards,
                                    math.inf if policy.depth is None else policy.depth[rank]))
        self.to_weight = m * k   # a B's W is the same (rank, chunk, span, micro-batch) one op on
        self.limit = cap * (1 + 1e-9)
        self.outputs = list(placer.outputs)     # O steps not placed yet
        # the F each O waits for
        self.output_need = {step: plan.needs[step][0] for step in self.outputs}
        self.load = list(placer.work)           # each rank's work, with the O's it took
        self.share, self.home = placer.share, placer.home
        self.slack = (policy.output_slack or 0.0) * placer.longest_output
        self.at_once = policy.promises == "at once"
        self.in_turn = policy.promises == "in turn"
        self.held_back = False
        self.wake = [(0.0, rank) for rank in range(problem.pp)]
        self.asleep: dict[int, float] = {}   # rank -> when it looks again (inf: by `watchers`)
        self.watchers: dict[int, list[int]] = {}   # unplaced step -> ranks asleep until placed

    def output_for(self, rank: int, state: _Rank, now: float) -> Optional[int]:
        """The oldest ready O this rank takes: one that fits beside what it holds, while its
        work stays within an even share of all the work plus the policy's slack; the last
        stage's rank takes one beyond that only when no other rank could (it is where the
        layer would otherwise be)."""
        # asked at every choice while O's are left, of each O left: its one dependency (the
        # last stage's F) and its bytes read inline, not by ready_at and fits
        plan, outputs, load = self.plan, self.outputs, self.load
        finished, alloc, held, limit = plan.finished, plan.alloc, state.held, self.limit
        spreads = self.policy.output_slack is not None
        for n, step in enumerate(outputs):
            if finished[self.output_need[step]] > now or held + alloc[step] > limit:
                continue
            room = [self.share + self.slack - load[r] >= plan.duration[step] and spreads
                    for r in range(self.problem.pp)]
            if room[rank] or (rank == self.home and not any(room)):
                del outputs[n]
                load[rank] += plan.duration[step]
                return step
        return None

    def safe(self, state: _Rank, unit: Steps) -> bool:
        """Whether, after `unit` allocates, the micro-batches holding or promised bytes on the
        rank can still finish one after another, oldest first: each gets what it was promised
        from what is free once the older ones have freed theirs."""
        plan, promise, promised = self.plan, self.promise, self.promised
        microbatch = plan.microbatch(unit[0])
        allocated = sum((plan.alloc[s] for s in unit), 0.0)
        promised_now = sum((promise.get(s, 0.0) - (plan.alloc[s] if s in promised else 0.0)
                            for s in unit), 0.0)
        free = self.limit - state.held - allocated
        for i in sorted(state.held_by.keys() | state.claims.keys() | {microbatch}):
            held, claim = state.held_by.get(i, 0.0), state.claims.get(i, 0.0)
            if i == microbatch:
                held, claim = held + allocated, claim + promised_now
            if claim > free:      # the first test also refuses what does not fit now
                return False
            free += held
        return True

    def room(self, state: _Rank, unit: Steps) -> bool:
        """Whether `unit` may allocate where promises are not kept at once: in turn (`safe`),
        or (none) where what it allocates fits beside what the rank holds now."""
        if self.in_turn:
            return self.safe(state, unit)
        return state.held + sum((self.plan.alloc[s] for s in unit), 0.0) <= self.limit

    def admissible(self, state: _Rank, unit: Steps) -> bool:
        """A forward unit runs when the rank has room for it and for what it promises."""
        promise = self.promise
        if unit[0] not in promise:   # its bytes were promised when its twin was admitted
            return self.at_once or self.room(state, unit)
        if state.in_flight + len(unit) > state.depth and state.in_flight > 0:
            return False
        if not self.at_once:
            return self.room(state, unit)
        need = sum((self.plan.alloc[s] + promise[s] for s in unit), 0.0)
        if state.held + state.reserved + need <= self.limit:
            return True
        self.held_back = self.held_back or state.held + need <= self.limit
        return False

    def choose(self, rank: int, state: _Rank, now: float) -> Optional[Steps]:
        plan, policy = self.plan, self.policy
        output = self.output_for(rank, state, now) if self.outputs else None
        if output is not None:      # the last stage's B waits for it: first
            return (output,)
        # the ready backward of the oldest micro-batch (the later chunk's first, or the
        # earlier's, by the policy)
        backward: Optional[deque[Steps]] = None
        best = (0, 0)
        for c, q in enumerate(state.backwards):
            if q and plan.ready_at(q[0][0]) <= now and \
                    (self.at_once or q[0][0] not in self.promised or self.room(state, q[0])):
                key = (plan.microbatch(q[0][0]), -c if policy.later_backward_first else c)
                if backward is None or key < best:
                    backward, best = q, key
        if backward is not None and not policy.forward_first:
            return backward.popleft()
        due = math.inf
        if policy.wait_for_backward and backward is None:
            for q in state.backwards:
                if q:
                    due = min(due, plan.ready_at(q[0][0]))
        V = self.problem.chunks
        for c in (reversed(range(V)) if policy.later_forward_first else range(V)):
            queue = state.forwards[c]
            if queue and plan.ready_at(queue[0][0]) <= now and self.admissible(state, queue[0]):
                if due < now + sum((plan.duration[s] for s in queue[0]), 0.0):
                    return None
                return queue.popleft()
        if backward is not None:
            return backward.popleft()
        if state.owed:
            return state.owed.popleft()
        return None

    def sleep(self, rank: int, now: float, heads: list[int]) -> None:
        """Idle `rank` until one of `heads` (the actions it waits for) may have become ready:
        at the soonest ready time after `now` among them, or when a dependency of one not
        ready yet is placed. Nothing else changes what `choose` returns: the rank's own bytes
        and queues change only when it runs an action, and a head once ready stays ready.
        (Waking every idle rank at every action's end instead gave the same programs, with a
        `choose` per idle rank per action placed.)"""
        plan, soonest = self.plan, math.inf
        for head in heads:
            ready = plan.ready_at(head)
            if ready == math.inf:
                for need in plan.needs[head]:
                    if plan.finished[need] == math.inf:
                        self.watchers.setdefault(need, []).append(rank)
            elif now < ready < soonest:
                soonest = ready
        self.asleep[rank] = soonest
        if soonest < math.inf:
            heapq.heappush(self.wake, (soonest, rank))

    def run(self) -> Placed:
        problem, plan, promise, promised = self.problem, self.plan, self.promise, self.promised
        ranks, wake, asleep, size = self.ranks, self.wake, self.asleep, self.size
        makespan = 0.0
        while wake:
            now, rank = heapq.heappop(wake)
            state = ranks[rank]
            if rank in asleep:
                if asleep[rank] != now:
                    continue              # superseded by an earlier wake-up
                del asleep[rank]
            if state.program and plan.finished[state.program[-1]] > now:
                continue                  # a stale wake-up: the rank is busy
            if not state.current:
                unit = self.choose(rank, state, now)
                if unit is not None:
                    state.current.extend(unit)
            if not state.current:
                if not state.done() or self.outputs:
                    self.sleep(rank, now, [q[0][0] for q in state.backwards + state.forwards if q]
                               + self.outputs[:2 * problem.pp])
                continue
            step = state.current[0]
            start = plan.ready_at(step)
            if start > now:
                if start < math.inf:
                    heapq.heappush(wake, (start, rank))
                else:
                    self.sleep(rank, now, [step])
                continue
            state.current.popleft()
            end = now + plan.duration[step]
            makespan = max(makespan, end)
            plan.finished[step] = end
            state.program.append(step)
            op = plan.op(step)
            state.held += plan.alloc[step] - plan.release[step]
            state.reserved += promise.get(step, 0.0) - (plan.alloc[step] if step in promised
                                                        else 0.0)
            state.in_flight += 1 if op == "F" else -1 if op == "B" else 0
            if self.in_turn:
                _account(state, plan.microbatch(step), plan.alloc[step] - plan.release[step],
                         promise.get(step, 0.0) - (plan.alloc[step] if step in promised else 0.0),
                         self.cap)
            if op == "B" and not state.current:
                state.owed.append(tuple(s + self.to_weight for s in state.program[-size:]))
            heapq.heappush(wake, (end, rank))
            for other in self.watchers.pop(step, []):   # it waited for this: look again then
                if asleep.get(other, -1.0) > end:
                    asleep[other] = end
                    heapq.heappush(wake, (end, other))
        m, k, V = problem.microbatches, problem.splits, problem.chunks
        stuck = [rank for rank, state in enumerate(ranks) if not state.done() or self.outputs]
        if stuck:
            raise ScheduleError(
                f"no order of F, B and W fits a memory cap of {self.cap:g} (pp={problem.pp}, "
                f"m={m}, k={k}, V={V}): ranks {stuck} cannot go on; raise the cap")
        return Placed([[plan.action(step) for step in state.program] for state in ranks],
                      makespan, self.held_back)


def _account(state: _Rank, microbatch: int, held: float, claim: float, cap: float) -> None:
    """Add to what `microbatch` holds and is promised on the rank; a micro-batch done with the
    rank (both back to zero, up to rounding) leaves the books."""
    state.held_by[microbatch] = state.held_by.get(microbatch, 0.0) + held
    state.claims[microbatch] = state.claims.get(microbatch, 0.0) + claim
    if abs(state.held_by[microbatch]) <= 1e-12 * cap and \
            abs(state.claims[microbatch]) <= 1e-12 * cap:
        del state.held_by[microbatch], state.claims[microbatch]


def place(problem: Problem, costs: SpanCosts, cap: float, policy: Policy = Policy()
          ) -> list[list[Action]]:
    """One greedy replay's programs (see Placer.place)."""
    return Placer(problem, costs).place(cap, policy).programs


def _promises(plan: _Plan, problem: Problem) -> tuple[dict[int, float], set[int]]:
    """Which forwards admit work and what they promise. A forward admits work unless it is
    chunk 1 of a V (that work entered the rank through chunk 0). Admitting F(i,j) promises the
    bytes of what it will make the rank allocate without asking: the dK/dV accumulators of B(i,k-1)
    (when j = 0) and, in a V, its twin F(i,j) on chunk 1 with that chunk's accumulators. Returns
    (admitting step -> promised bytes, the steps whose bytes were promised)."""
    k, vshape = problem.splits, problem.placement == "vshape"
    promise: dict[int, float] = {}
    promised: set[int] = set()
    for rank in range(problem.pp):
        for chunk in ((0,) if vshape else range(problem.chunks)):
            for i in range(problem.microbatches):
                for j in range(k):
                    caused = [plan.step(rank, c, "B", k - 1, i)
                              for c in ((0, 1) if vshape else (chunk,))] if j == 0 else []
                    if vshape:
                        caused.append(plan.step(rank, 1, "F", j, i))
                    promise[plan.step(rank, chunk, "F", j, i)] = sum(
                        (plan.alloc[s] for s in caused), 0.0)
                    promised.update(caused)
    return promise, promised
