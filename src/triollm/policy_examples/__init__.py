"""Example scheduling policies that teach, each small enough to read in a minute.

- :mod:`.shortest_prompt_first`: admit the shortest prompt first. The plain version
  starves long prompts, and ``triollm check-policy`` finds the starvation; the aged
  one bounds it and is proved.
- :mod:`.priority`: requests carry a ``priority`` (smaller first, as vLLM's priority
  scheduling), with an aging bound so low priorities are not starved either.
- :mod:`.leaky`: deliberately broken (a spare block per sequence that nothing ever
  writes); the harness must catch the leak.

docs/policies.md walks through writing one from an empty file.
"""
