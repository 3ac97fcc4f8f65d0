"""The prefill/decode hand-off's rules (kdn.integrations.vllm.disaggregated), vLLM-free: what a
prefiller hands its decoder, what the decoder waits for (whole chunks, never its last token), and
that a wait ends at its bound, counted; the engines themselves are in test_vllm_deployments.py."""

from types import SimpleNamespace

import pytest

from kdn import InvalidInputError
from kdn.integrations.vllm.disaggregated import Handoffs, Role, expected, handed_off


def request(n: int, params=None):
    return SimpleNamespace(prompt_token_ids=list(range(n)), kv_transfer_params=params)


def test_roles_are_vllms_and_a_prefiller_hands_its_decoder_what_it_stored():
    assert Role.of("kv_producer", 5.0) == Role(loads=False, stores=True, wait_s=5.0)
    assert Role.of("kv_consumer", 5.0) == Role(loads=True, stores=False, wait_s=5.0)
    assert Role.of(None, 1.0) == Role.of("kv_both", 1.0) == Role(True, True, 1.0)
    with pytest.raises(InvalidInputError, match="kv_role 'kv_prefill'"):
        Role.of("kv_prefill", 1.0)
    producer, remote = Role.of("kv_producer", 1.0), {"do_remote_decode": True}
    assert handed_off(producer, request(700), stored=True) is None  # no do_remote_decode: no hand-off
    assert handed_off(producer, request(700, remote), stored=True) == {
        "do_remote_prefill": True, "do_remote_decode": False, "kdn": {"prefilled": 700}}
    assert handed_off(producer, request(700, remote), stored=False)["kdn"] == {"prefilled": 0}
    # kdn beside the hand-off's connector (kv_both in a MultiConnector): that one's parameters, never kdn's
    assert handed_off(Role.of("kv_both", 1.0), request(700, remote), stored=True) is None


@pytest.mark.parametrize("n, params, want", [
    (700, {"do_remote_prefill": True, "kdn": {"prefilled": 700}}, 512),  # whole chunks only
    (513, {"do_remote_prefill": True, "kdn": {"prefilled": 513}}, 512),
    (512, {"do_remote_prefill": True, "kdn": {"prefilled": 512}}, 256),  # never the last token
    (700, {"do_remote_prefill": True, "kdn": {"prefilled": 300}}, 256),  # the prefiller stored less
    (700, {"do_remote_prefill": True, "kdn": {"prefilled": 9999}}, 512),  # a claim past the prompt: clamped
    (700, {"do_remote_prefill": True, "kdn": {"prefilled": True}}, 0),  # not a count
    (700, {"do_remote_prefill": True, "kdn": "700"}, 0),
    (700, {"kdn": {"prefilled": 700}}, 0),  # no hand-off asked
    (700, None, 0)])
def test_a_decoder_waits_for_the_whole_chunks_its_prefiller_said_it_stored(n, params, want):
    assert expected(request(n, params), 256) == want


def test_a_wait_ends_when_the_store_lands_or_at_its_bound_and_is_counted_once():
    now = [0.0]
    counted = {"prefill_waits": 0, "prefill_wait_timeouts": 0}

    def count(**deltas):
        for name, n in deltas.items():
            counted[name] += n

    handoffs = Handoffs(10.0, count, clock=lambda: now[0])
    assert not handoffs.waits("a", 512, 512)  # landed: no wait
    assert handoffs.waits("b", 256, 512) and handoffs.waits("b", 256, 512)  # still landing
    now[0] = 9.9
    assert handoffs.waits("b", 256, 512)
    now[0] = 10.0
    assert not handoffs.waits("b", 256, 512)  # its bound: computed
    assert not handoffs.waits("b", 0, 512)  # and not again (a preempted request asks again)
    assert handoffs.waits("c", 0, 512)
    now[0] = 12.0
    assert not handoffs.waits("c", 512, 512)  # its prefiller's store landed meanwhile
    handoffs.forget("b")
    assert handoffs.waits("b", 0, 512)  # a new request of that id waits anew
    assert counted == {"prefill_waits": 3, "prefill_wait_timeouts": 1}
