"""Token-in-token-out: each turn's ids as the server gave them, stored once per turn beyond the
prefix it shares with the turn before, and the episode's token view rebuilt from them, for an
append-only conversation (one sequence with its mask) and a rewritten one (one sample per
turn). The server here is the scripted one (vLLM-shaped ids from a byte-level template)."""

from __future__ import annotations

import json

import pytest

from rollout_wire.byte_template import END, render_prompt
from rollout_wire.tokens import token_view
from rollout_worker.cli.policy_server import completion
from tests.runner_program import episode

ASK = episode.TOKEN_REQUEST


def turn(messages, number, *, version=None):
    """The scripted server's answer to `messages` (its turn `number`): a tool call."""
    request = {"model": "m", "messages": messages, **ASK}
    script = {"tool": "run", "arguments": {"command": f"python -m unittest  # {number}"}}
    return completion(request, script, f"call-{number}", version)


def steps_of(conversation_turns):
    """The steps a runner records for these (messages, response) turns."""
    steps, sequence = [], []
    for number, (_, response) in enumerate(conversation_turns, 1):
        tokens, sequence, shown = episode.turn_tokens(response, sequence)
        steps.append({"step": number, "response": shown, "tokens": tokens, "policy_version": "3"})
    return steps


def conversation(rewrite=False, turns=3):
    messages = [{"role": "system", "content": "fix it"}, {"role": "user", "content": "go"}]
    done = []
    for number in range(1, turns + 1):
        response = turn(list(messages), number)
        done.append((list(messages), response))
        message = dict(response["choices"][0]["message"])
        if rewrite and number == 2:
            message = {"role": "assistant", "content": "(summarised)"}  # a scaffold's rewrite
        messages += [message, {"role": "tool", "tool_call_id": f"call-{number}", "content": "ok"}]
    return done


def test_an_append_only_conversation_is_one_sequence_with_the_models_ids_masked_in():
    done = conversation()
    steps = steps_of(done)
    # Stored once: each later turn keeps only what its prompt adds after the last completion.
    firsts = [s["tokens"]["prompt_reused"] for s in steps]
    assert firsts[0] == 0 and all(n > 0 for n in firsts[1:])
    assert all("prompt_token_ids" not in s["response"] for s in steps)
    assert all("token_ids" not in s["response"]["choices"][0] for s in steps)
    view = token_view(steps)
    assert (view["tokens"], view["layout"], view["prefix_broke_at"]) == (
        "available",
        "sequence",
        None,
    )
    prompts = [render_prompt(messages) for messages, _ in done]
    completions = [response["choices"][0]["token_ids"] for _, response in done]
    assert view["prompt_ids"] == prompts[0]
    # Every turn's prompt is the sequence so far: no id made up, none lost.
    whole = view["prompt_ids"] + view["response_ids"]
    for number, bound in enumerate(view["turns"]):
        start = len(view["prompt_ids"]) + bound["start"]
        assert whole[:start] == prompts[number]
        assert view["response_ids"][bound["start"] : bound["end"]] == completions[number]
        assert bound["policy_version"] == "3"
    model = [i for i, m in enumerate(view["response_mask"]) if m == 1]
    assert len(model) == sum(map(len, completions))
    # Log-probabilities where the model sampled, 0.0 where the environment spoke.
    for position, (mask, logprob) in enumerate(
        zip(view["response_mask"], view["response_logprobs"], strict=True)
    ):
        assert (logprob == 0.0) == (mask == 0), position
    assert len(view["response_ids"]) == len(view["response_mask"]) == len(view["response_logprobs"])


def test_a_rewritten_context_gives_one_sample_per_turn_and_names_where_the_prefix_broke():
    done = conversation(rewrite=True)
    view = token_view(steps_of(done))
    assert (view["layout"], view["prefix_broke_at"]) == ("stepwise", 3)
    for sample, (messages, response) in zip(view["samples"], done, strict=True):
        assert sample["prompt_ids"] == render_prompt(messages)
        assert sample["response_ids"] == response["choices"][0]["token_ids"]
        assert sample["response_mask"] == [1] * len(sample["response_ids"])


def test_a_finished_answer_ends_with_the_id_its_next_prompt_closes_the_message_with():
    # Why append-only holds on a real engine: EOS is the last sampled id and the template
    # closes the assistant message with it, so the next prompt adds only the environment's.
    done = conversation(turns=2)
    view = token_view(steps_of(done))
    first, second = view["turns"]
    assert view["response_ids"][first["end"] - 1] == END
    added = view["response_ids"][first["end"] : second["start"]]
    assert added == render_prompt(done[1][0])[-len(added) :]
    assert added[:2] == [1, 6]  # [START, tool]: the tool's answer opens what comes next


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (lambda r: r.pop("prompt_token_ids"), "no token ids"),
        (lambda r: r["choices"][0].pop("logprobs"), "no log-probability"),
        (lambda r: r["choices"][0].update(token_ids=["a"]), "not all integers"),
    ],
)
def test_a_server_without_ids_gives_unavailable_with_the_reason_never_a_guess(change, reason):
    done = conversation(turns=2)
    change(done[1][1])
    steps = steps_of(done)
    assert reason in steps[1]["tokens"]["unavailable"]
    view = token_view(steps)
    assert view["tokens"] == "unavailable" and view["reason"].startswith("turn 2: ")


def test_a_batch_that_asks_for_no_ids_sends_no_token_fields_and_says_so():
    asking = episode.Policy({"model": "m"}, "ep", {"group_id": "g", "task_id": "t", "sample": 0})
    quiet = episode.Policy(
        {"model": "m", "tokens": False}, "ep", {"group_id": "g", "task_id": "t", "sample": 0}
    )
    assert asking.token_request == ASK and quiet.token_request == {}
    sent, refused = episode.agent_request({"messages": []}, {}, "m", quiet.token_request)
    assert "return_token_ids" not in sent and refused == []
    sent, refused = episode.agent_request({"messages": []}, {}, "m", asking.token_request)
    assert sent["return_token_ids"] is True and sent["logprobs"] is True and refused == []
    record, _, _ = episode.turn_record(quiet.token_request, turn([], 1), b"", [])
    assert "tokens: false" in record["unavailable"]


def test_a_turn_too_large_to_log_loses_its_ids_with_the_reason_not_the_step():
    done = conversation(turns=1)
    tokens, _, shown = episode.turn_tokens(done[0][1], [])
    tokens["prompt_ids"] = list(range(60_000))  # ~350 KB of ids
    fields = {"step": 1, "request": {}, "new_messages": [], "response": shown, "tokens": tokens}
    fitted = episode.fit_step(fields)
    assert "too large" in fitted["tokens"]["unavailable"]
    assert fitted["response"] == shown
    assert len(json.dumps(fitted)) <= episode.MAX_STEP_EVENT_BYTES


def test_failed_turns_are_no_samples_and_malformed_records_are_refused():
    steps = steps_of(conversation(turns=2))
    failed = {"step": 9, "response": None, "error": "HTTP 500"}
    assert token_view([steps[0], failed, steps[1]])["layout"] == "sequence"
    assert token_view([failed])["reason"] == "no turn was answered"
    broken = dict(steps[1], tokens=dict(steps[1]["tokens"], prompt_reused=10**6))
    assert token_view([steps[0], broken])["tokens"] == "unavailable"


def test_sglangs_field_names_give_the_same_record():
    # SGLang 0.5.23 puts both ids on the choice: prompt_token_ids and response_token_ids.
    vllm = turn(list(conversation(turns=1)[0][0]), 1)
    sglang = json.loads(json.dumps(vllm))
    choice = sglang["choices"][0]
    choice["prompt_token_ids"] = sglang.pop("prompt_token_ids")
    choice["response_token_ids"] = choice.pop("token_ids")
    ours, _, _ = episode.turn_tokens(vllm, [])
    theirs, _, shown = episode.turn_tokens(sglang, [])
    assert theirs == ours and "completion_ids" in theirs
    assert not {"prompt_token_ids", "response_token_ids"} & set(shown["choices"][0])
