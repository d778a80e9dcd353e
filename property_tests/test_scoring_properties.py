"""A scored prompt (Scheduler rule 11: echo with logprobs), checked by hypothesis.

The scheduler machine of ``triollm check-policy`` with one more verb: a prompt whose
log-probabilities are asked for arrives (``add(..., score_prompt=True)``), opening
with one of the shared openings so that the prefix cache would hit, and with a
``max_tokens`` that may be 0. Every claim and check of that machine still runs; the
machine's ``_check_scoring`` holds such a sequence to rule 11 at every plan: its
chunks cover the prompt from position 0 without a gap (no cache hit), again from 0
after a preemption, each row naming its next prompt token, and only its final chunk
is sampled (none with ``max_tokens`` 0, which ends it with ``length``).

The base machine (and so check-policy's search) is unchanged: the rule lives in
this subclass only.
"""

from __future__ import annotations

from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import rule

from triollm.check.machine import OPENINGS, STOP, SchedulerMachine
from triollm.policies import Policy
from triollm.spec import SequenceSpec


class ScoringMachine(SchedulerMachine):
    PREFIX_CACHE = True  # the cache is what a scored prompt must refuse

    @rule(data=st.data(), opening=st.sampled_from(OPENINGS))
    def arrive_scoring(self, data: st.DataObject, opening: tuple[int, ...]) -> None:
        most = self.longest_request()
        if most < 2:
            return
        prompt = data.draw(st.integers(1, most - 1), label="prompt")
        max_tokens = data.draw(st.integers(0, most - prompt), label="max_tokens")
        ids = [*opening, *(1 + i % 7 for i in range(max(0, prompt - len(opening))))]
        seq = self.s.add(
            SequenceSpec(ids[:prompt], max_tokens, frozenset({STOP}), score_prompt=True)
        )
        self.scoring[seq] = (0, 0)
        if max_tokens == 0:
            event("a prompt was scored with max_tokens 0")
        self.say(f"seq {seq} arrives: prompt {prompt}, scored, max_tokens {max_tokens}")
        self.issued.append(seq)


def scoring_machine(policy: Policy) -> type[ScoringMachine]:
    return type(f"Scoring_{policy.value}", (ScoringMachine,), {"POLICY": policy})


TestReserveScoring = scoring_machine(Policy.RESERVE).TestCase
TestPreemptScoring = scoring_machine(Policy.PREEMPT).TestCase
