"""The n choices of one prompt (Scheduler rule 10), checked by hypothesis.

The scheduler machine of ``triollm check-policy`` with one more verb: a group of
2-3 sequences of one prompt arrives (``Scheduler.add_group``), its prompt drawn
from the shared openings so that the prefix cache, when on, hits too. Every
claim and check of that machine still runs, made group-aware where a group
changes the statement (a shared block may have one writer while the others wait
for it; a group passes the oldest waiter as one). Added here:

- ``a_group_is_admitted_whole``: no member of a group runs while another one that
  was never admitted still waits (all or none, so a half-admitted group can never
  sit on blocks while it waits for the rest);
- ``a_waiting_member_waits_for_a_running_writer_of_its_own_group``.

The base machine (and so check-policy's search) is unchanged: the rule lives in
this subclass only.
"""

from __future__ import annotations

from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import invariant, rule

from triollm.check.machine import OPENINGS, SALTS, STOP, SchedulerMachine
from triollm.policies import Claim, Policy
from triollm.scheduler import RUNNING_STATES, Infeasible, SeqState
from triollm.spec import SequenceSpec


class GroupMachine(SchedulerMachine):
    def __init__(self) -> None:
        super().__init__()
        # Groups share blocks by design; what replaces the claim is _check_shared.
        self.claims = self.claims - {Claim.EXCLUSIVE_BLOCKS}
        self.groups: list[tuple[int, ...]] = []

    @rule(
        data=st.data(),
        opening=st.sampled_from(OPENINGS),
        salt=st.sampled_from(SALTS),
        n=st.integers(2, 3),
    )
    def arrive_group(
        self, data: st.DataObject, opening: tuple[int, ...], salt: str, n: int
    ) -> None:
        most = self.longest_request()
        if most < 2:
            return
        prompt, max_tokens = self.draw_lengths(data, most)
        ids = [*opening, *(1 + i % 7 for i in range(max(0, prompt - len(opening))))][:prompt]
        try:
            seqs = self.s.add_group(
                SequenceSpec(ids, max_tokens, frozenset({STOP}), n=n, cache_salt=salt)
            )
        except Infeasible as exc:
            assert exc.field == "n", exc  # one member fits (drawn so), so only n can be
            self.say(f"a group of {n} arrives: prompt {prompt}, refused ({exc})")
            return
        self.say(
            f"a group of {n} arrives as seqs {list(seqs)}: prompt {prompt} opening with "
            f"{opening[:3]}..., salt {salt!r}, max_tokens {max_tokens}"
        )
        for seq in seqs:
            self.salt[seq] = salt
            self.group_of[seq] = len(self.groups)
            self.issued.append(seq)
        self.groups.append(seqs)

    @invariant()
    def a_group_is_admitted_whole(self) -> None:
        for seqs in self.groups:
            live = [q for q in seqs if q not in self.ended]
            states = {q: self.s.state(q) for q in live}
            never_admitted = [
                q
                for q in live
                if states[q] is SeqState.WAITING and not self.s.sequence(q).preemptions
            ]
            admitted = [q for q in live if q not in never_admitted]
            if len(admitted) > 1:
                event("a group ran")
            assert not (never_admitted and admitted), (
                f"group {list(seqs)} is half admitted: {admitted} admitted while "
                f"{never_admitted} still wait"
            )

    @invariant()
    def a_waiting_member_waits_for_a_running_writer_of_its_own_group(self) -> None:
        for q in self.s.running_ids():
            writer = self.s.sequence(q).waits_for
            if writer is None:
                continue
            event("a member waited for its writer")
            if writer != min(q2 for q2 in self.group_of if self.group_of[q2] == self.group_of[q]):
                event("a writer handed the shared blocks over")
            assert self.group_of.get(writer) == self.group_of.get(q) is not None
            assert self.s.state(writer) in RUNNING_STATES
            assert self.s.sequence(writer).waits_for is None


def group_machine(policy: Policy, *, prefix_cache: bool) -> type[GroupMachine]:
    return type(
        f"Groups_{policy.value}{'_prefix_cache' if prefix_cache else ''}",
        (GroupMachine,),
        {"POLICY": policy, "PREFIX_CACHE": prefix_cache},
    )


TestReserveGroups = group_machine(Policy.RESERVE, prefix_cache=False).TestCase
TestReserveGroupsPrefixCache = group_machine(Policy.RESERVE, prefix_cache=True).TestCase
TestPreemptGroupsPrefixCache = group_machine(Policy.PREEMPT, prefix_cache=True).TestCase
