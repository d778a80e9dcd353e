"""The policy interface: the built-ins run through it, and a bad policy is refused or caught."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from triollm.plan import SampledToken, StepResult
from triollm.policies import (
    BasePolicy,
    Claim,
    Policy,
    PolicyError,
    Reserve,
    SeqView,
    load_policy,
    missing_members,
)
from triollm.scheduler import Scheduler, SchedulerConfig
from triollm.sim.runner import simulate
from triollm.sim.scenario import seed_scenario
from triollm.spec import SequenceSpec


def make(policy: object, **kw: object) -> Scheduler:
    base: dict[str, object] = dict(
        num_blocks=16, block_size=4, slots=4, chunk_tokens=8, step_rows=12, context_tokens=64
    )
    base.update(kw)
    return Scheduler(SchedulerConfig(policy=policy, **base))  # type: ignore[arg-type]


def test_each_builtin_name_is_an_object_with_the_interface() -> None:
    for p in Policy:
        assert missing_members(p.implementation) == []
        assert p.implementation.name == p.value
        assert load_policy(p.value) is p.implementation


def test_a_builtin_given_as_an_object_replays_the_seed_exactly_as_its_name() -> None:
    for p in Policy:
        by_name = simulate(seed_scenario(), p)
        by_object = simulate(seed_scenario(), type(p.implementation)())
        assert by_object.steps == by_name.steps, p
        assert by_object.outcomes == by_name.outcomes, p


def test_an_object_that_is_not_a_policy_is_refused_naming_what_it_lacks() -> None:
    class HalfAPolicy:
        name = "half"
        claims = frozenset({Claim.NO_DEADLOCK})

        def admission_blocks(self, seq: SeqView, view: object) -> tuple[int, int]:
            return 1, 0

    with pytest.raises(ValueError) as err:
        SchedulerConfig(num_blocks=4, policy=HalfAPolicy())  # type: ignore[arg-type]
    message = str(err.value)
    for member in (
        "description",
        "grows",
        "deterministic",
        "orders_by_priority",
        "on_dry_pool()",
        "waiting_order()",
    ):
        assert member in message
    assert "admission_blocks" not in message


def test_claims_must_be_claim_members() -> None:
    class StringlyClaims(Reserve):
        claims = frozenset({"no-deadlock"})  # type: ignore[assignment]

    assert missing_members(StringlyClaims()) == ["claims as a set of Claim members"]


def test_load_policy_names_a_missing_module_and_a_missing_attribute() -> None:
    with pytest.raises(ValueError, match="cannot import no_such_module_here"):
        load_policy("no_such_module_here:Mine")
    with pytest.raises(ValueError, match="has no attribute 'Nope'"):
        load_policy("triollm.policies:Nope")
    with pytest.raises(ValueError, match="module:Name"):
        load_policy("lifo")


def test_load_policy_reads_a_file_and_instantiates_a_class(tmp_path: object) -> None:
    from pathlib import Path

    f = Path(str(tmp_path)) / "lifo_policy.py"
    f.write_text(
        "from triollm.policies import BasePolicy\n"
        "class Lifo(BasePolicy):\n"
        "    name = 'lifo'\n"
        "    def waiting_order(self, waiting):\n"
        "        return [s.seq_id for s in reversed(waiting)]\n"
    )
    policy = load_policy(f"{f}:Lifo")
    assert policy.name == "lifo"
    s = make(policy, slots=1)
    first, second = s.add(SequenceSpec([1, 2], 2)), s.add(SequenceSpec([1, 2], 2))
    assert s.admit_waiting() == (second,)
    assert s.waiting_ids() == (first,)


def test_a_waiting_order_that_drops_a_waiter_is_a_policy_error() -> None:
    class Forgetful(BasePolicy):
        def waiting_order(self, waiting: Sequence[SeqView]) -> Sequence[int]:
            return [s.seq_id for s in waiting][1:]

    s = make(Forgetful())
    s.add(SequenceSpec([1, 2], 2))
    with pytest.raises(PolicyError, match="not an order of the waiters"):
        s.admit_waiting()


def test_admission_that_does_not_cover_the_prefill_is_a_policy_error() -> None:
    class Stingy(BasePolicy):
        grows = True

        def admission_blocks(self, seq: SeqView, view: object) -> tuple[int, int]:
            return 1, 0

    s = make(Stingy())
    s.add(SequenceSpec([1] * 9, 2))  # 9 positions need 3 blocks of 4
    with pytest.raises(PolicyError, match="must take at least 3 block"):
        s.admit_waiting()
    assert s.pool.statistics().free == 16  # nothing was taken


def test_a_victim_that_is_not_running_is_a_policy_error() -> None:
    class WildShot(BasePolicy):
        grows = True

        def admission_blocks(self, seq: SeqView, view: object) -> tuple[int, int]:
            return -(-seq.n_tokens // 4), 0

        def on_dry_pool(self, needing: SeqView, running: Sequence[SeqView]) -> int | None:
            return 99

    s = make(WildShot(), num_blocks=2, slots=2)
    a, b = s.add(SequenceSpec([1, 2, 3, 4], 4)), s.add(SequenceSpec([1, 2, 3, 4], 4))
    assert s.admit_waiting() == (a, b)  # one block each: the pool is dry
    plan = s.plan_step()
    s.commit(StepResult(plan.step, (SampledToken(a, 5), SampledToken(b, 5))))
    with pytest.raises(PolicyError, match="on_dry_pool chose 99"):
        s.plan_step()


def test_simulate_loads_a_policy_by_module_and_name(capsys: pytest.CaptureFixture[str]) -> None:
    from triollm.cli import main

    spec = "triollm.policy_examples.shortest_prompt_first:ShortestPromptFirst"
    assert main(["simulate", "--policy", spec, "--policy", "reserve"]) == 0
    out = capsys.readouterr().out
    assert "== shortest-prompt-first: admit the shortest waiting prompt first" in out
    assert "== reserve:" in out
    assert main(["simulate", "--policy", "lifo"]) == 2
    assert "--policy: policy must be one of" in capsys.readouterr().err
