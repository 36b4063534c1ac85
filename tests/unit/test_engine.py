"""The tiny engine is a real one: it samples from its model, reports the log-probability each
token was sampled with (a teacher-forced pass over the same ids agrees), renders prompts with
the template the scripted server uses (append-only when answers are carried back), takes new
weights with a new version, and refuses bad requests as vLLM would (400)."""

from __future__ import annotations

import io
import json
import urllib.error
import urllib.request

import pytest
import torch

from rollout_wire.byte_template import END, render_prompt
from trainer_stub import engine

pytestmark = pytest.mark.train


@pytest.fixture(scope="module")
def server():
    running = engine.EngineServer(engine.build_model(seed=0)).start()
    yield running
    running.close()


def post(url, body, headers=None):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(
        url, data=data, headers={"Content-Type": "application/json", **(headers or {})}
    )
    with urllib.request.urlopen(request, timeout=30) as answer:
        return json.load(answer), answer.headers


def ask(server, messages, **extra):
    body = {"messages": messages, "max_tokens": 12, "logprobs": True, "return_token_ids": True}
    return post(f"{server.url}/rollout/ep-1/v1/chat/completions", body | extra)


CONVERSATION = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]


def test_answers_carry_the_ids_and_the_logprobs_they_were_sampled_with(server):
    answer, headers = ask(server, CONVERSATION, seed=7)
    choice = answer["choices"][0]
    ids = choice["token_ids"]
    assert answer["prompt_token_ids"] == render_prompt(CONVERSATION)
    assert len(ids) == len(choice["logprobs"]["content"]) == answer["usage"]["completion_tokens"]
    assert headers["X-Policy-Version"] == answer["metadata"]["weight_version"]
    # No drift: a fresh forward pass over prompt + completion gives the same log-probabilities.
    whole = torch.tensor([answer["prompt_token_ids"] + ids])
    with torch.no_grad():
        logp = torch.log_softmax(server.model(input_ids=whole).logits[0].float(), dim=-1)
    start = len(answer["prompt_token_ids"])
    again = [float(logp[start - 1 + n, token]) for n, token in enumerate(ids)]
    sampled = [entry["logprob"] for entry in choice["logprobs"]["content"]]
    assert again == pytest.approx(sampled, abs=1e-4)
    # The engine's own ledger holds the same ids, under the episode's name.
    assert server.ledger()["ep-1"][-1]["completion_ids"] == ids
    # Same seed, same answer: sampling is the model's, not noise from elsewhere.
    assert ask(server, CONVERSATION, seed=7)[0]["choices"][0]["token_ids"] == ids


def test_a_finished_answer_carried_back_gives_an_append_only_prompt(server):
    for seed in range(40):
        answer, _ = ask(server, CONVERSATION, seed=seed, max_tokens=64)
        if answer["choices"][0]["finish_reason"] == "stop":
            break
    else:
        pytest.fail("no answer of 40 stopped at END")
    ids = answer["choices"][0]["token_ids"]
    assert ids[-1] == END
    message = answer["choices"][0]["message"]
    follow = [*CONVERSATION, message, {"role": "user", "content": "again"}]
    second, _ = ask(server, follow)
    first = answer["prompt_token_ids"] + ids
    # The template closes the carried-back answer with END: the prefix holds exactly when its
    # text gives back the sampled ids (a random model's bytes often are no UTF-8, and special
    # ids have no text: then the prefix breaks, the drift re-tokenizing would cause).
    round_trip = render_prompt([message])[2:-2] == ids
    assert (second["prompt_token_ids"][: len(first)] == first) is round_trip


def test_new_weights_bump_the_version_and_change_the_answers(server):
    before, headers = ask(server, CONVERSATION, seed=3, temperature=0)
    version = int(headers["X-Policy-Version"])
    other = engine.build_model(seed=1).state_dict()
    buffer = io.BytesIO()
    torch.save(other, buffer)
    done, _ = post(f"{server.url}/weights", buffer.getvalue(), {"Content-Type": "x/torch"})
    assert done == {"version": version + 1}
    after, headers = ask(server, CONVERSATION, seed=3, temperature=0)
    assert headers["X-Policy-Version"] == str(version + 1)

    def logprobs(answer):
        return [e["logprob"] for e in answer["choices"][0]["logprobs"]["content"]]

    assert logprobs(after) != pytest.approx(logprobs(before), abs=1e-3)
    done, _ = post(
        f"{server.url}/weights", buffer.getvalue(), {"Content-Type": "x/t", "X-Policy-Version": "9"}
    )
    assert done == {"version": 9}


@pytest.mark.parametrize(
    ("body", "why"),
    [
        (b"not json", "not JSON"),
        ({"messages": "hi"}, "messages must be a list"),
        ({"messages": [], "n": 2}, "n must be 1"),
        ({"messages": [], "max_tokens": 100000}, "max_tokens"),
        ({"messages": [], "stream": True}, "stream"),
    ],
)
def test_bad_requests_get_a_400_with_the_reason(server, body, why):
    with pytest.raises(urllib.error.HTTPError) as refused:
        post(f"{server.url}/v1/chat/completions", body)
    assert refused.value.code == 400
    assert why in json.load(refused.value)["error"]["message"]


def test_the_tokenizer_decodes_what_the_template_encodes():
    tokenizer = engine.build_tokenizer()
    ids = render_prompt([{"role": "user", "content": "héllo"}])
    assert "héllo" in tokenizer.decode(ids, skip_special_tokens=True)
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id) == (0, END)
