"""Chain acceptance: the longest prefix of the draft that the target agrees with, plus one token of the target.

The target's choice at each verified position is made with the request's own sampling (greedy, or temperature /
top-p / top-k through the sampler), so accepting a draft token exactly when the target would have chosen it keeps
the output distribution the target's. `force_accept` (benchmarks with dummy weights only) accepts a fixed number
of draft tokens whatever the target says.
"""

from __future__ import annotations


def accept_chain(target_choices: list[int], drafts: list[int], force_accept: int | None = None) -> list[int]:
    """Emitted tokens: drafts[:j] + [target_choices[j]].

    target_choices: the target's token at each of the len(drafts) + 1 verified positions (position i follows
    the window's first i + 1 tokens). j = the number of leading drafts equal to the target's choices, or
    min(force_accept, len(drafts)) when forced.
    """
    if len(target_choices) != len(drafts) + 1:
        raise ValueError(f"{len(target_choices)} target choices for {len(drafts)} drafts")
    if force_accept is not None:
        j = min(force_accept, len(drafts))
    else:
        j = 0
        while j < len(drafts) and drafts[j] == target_choices[j]:
            j += 1
    return drafts[:j] + [target_choices[j]]
