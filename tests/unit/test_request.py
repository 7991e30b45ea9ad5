"""The request state machine: allowed moves work, illegal ones raise InvalidTransition."""

from __future__ import annotations

import pytest

from tokenspeed.core.request import InvalidTransition, Request, RequestState
from tokenspeed.core.sampling_params import SamplingParams

S = RequestState


def _req() -> Request:
    return Request("r", [1, 2, 3], SamplingParams())


def test_lifecycle_with_preemption() -> None:
    r = _req()
    for state in (S.RUNNING, S.PREEMPTED, S.RUNNING, S.FINISHED):
        r.transition(state)
    assert r.state.is_done


@pytest.mark.parametrize("path", [
    [S.FINISHED], [S.PREEMPTED], [S.RUNNING, S.WAITING], [S.RUNNING, S.FINISHED, S.RUNNING],
    [S.ABORTED, S.RUNNING], [S.RUNNING, S.PREEMPTED, S.FINISHED],
])
def test_illegal_transitions_raise(path) -> None:
    r = _req()
    with pytest.raises(InvalidTransition):
        for state in path:
            r.transition(state)


@pytest.mark.parametrize("before", [[], [S.RUNNING], [S.RUNNING, S.PREEMPTED]])
def test_abort_from_any_live_state(before) -> None:
    r = _req()
    for state in before:
        r.transition(state)
    r.transition(S.ABORTED)
    assert r.state.is_done


def test_token_bookkeeping() -> None:
    r = _req()
    r.append_output(7)
    assert r.all_token_ids == [1, 2, 3, 7] and r.num_tokens == 4 and r.num_uncomputed_tokens == 4
