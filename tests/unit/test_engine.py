"""The tiny engine is a real one: it samples from its model, reports the log-probability each
token was sampled with (a teacher-forced pass over the same ids agrees), renders prompts with
the template the scripted server uses (append-only when answers are carried back), takes new
weights with a new version, streams as the recording proxy expects, refuses bad requests as
vLLM would (400), and its tokenizer is what TRL's GRPOTrainer needs as processing_class."""

from __future__ import annotations

import io
import json
import os
import random
import threading
import urllib.error
import urllib.request

import pytest
import torch

from rollout_wire.byte_template import END, START, decode, render_prompt, text_ids
from rollout_worker.cli import policy_server
from tests.runner_program import episode
from trainer_stub import engine

assemble_stream = episode.assemble_stream

pytestmark = pytest.mark.train


@pytest.fixture(scope="module")
def server():
    with engine.EngineServer(engine.build_model(seed=0)) as running:
        yield running


def post(url, body, headers=None):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(
        url, data=data, headers={"Content-Type": "application/json", **(headers or {})}
    )
    with urllib.request.urlopen(request, timeout=30) as answer:
        return json.load(answer), answer.headers


def get(url):
    with urllib.request.urlopen(url, timeout=30) as answer:
        return json.load(answer), answer.headers


def ask(server, messages, episode="ep-1", **extra):
    body = {"messages": messages, "max_tokens": 12, "logprobs": True, "return_token_ids": True}
    return post(f"{server.url}/rollout/{episode}/v1/chat/completions", body | extra)


def ids_of(answer):
    return answer["choices"][0]["token_ids"]


def logprobs_of(answer):
    return [entry["logprob"] for entry in answer["choices"][0]["logprobs"]["content"]]


CONVERSATION = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]

CONVERSATIONS = [
    CONVERSATION,
    [],
    [{"role": "user", "content": "héllo wörld, 日本 😀"}],
    [
        {"role": "user", "content": "fix it"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "run", "arguments": "{}"}},
                {
                    "id": "c2",
                    "type": "function",
                    "function": {"name": "read_file", "arguments": '{"path": "a.py"}'},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "ok\n"},
        {"role": "assistant", "content": "done"},
        {"role": "user", "content": [{"type": "text", "text": "parts"}]},
        {"role": "developer", "content": "an unknown role"},
    ],
]


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_prompts_are_rendered_with_the_scripted_servers_template(server, messages):
    expected = policy_server.render_prompt(messages)
    assert engine.render_prompt(messages) == expected
    assert expected[-2:] == [START, 5]
    answer, _ = ask(server, messages)
    assert answer["prompt_token_ids"] == expected
    assert answer["usage"]["prompt_tokens"] == len(expected)


def test_models_and_answers_are_deterministic_under_a_seed(server):
    first, again, other = (engine.build_model(seed=s).state_dict() for s in (0, 0, 1))
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert not all(torch.equal(first[k], other[k]) for k in first)
    answers = [ids_of(ask(server, CONVERSATION, seed=seed)[0]) for seed in (7, 7, 8, 9)]
    assert answers[0] == answers[1]
    assert answers[0] != answers[2] or answers[0] != answers[3]
    greedy = [ids_of(ask(server, CONVERSATION, seed=s, temperature=0)[0]) for s in (1, 2)]
    assert greedy[0] == greedy[1]


def test_answers_carry_the_ids_and_the_logprobs_they_were_sampled_with(server):
    answer, headers = ask(server, CONVERSATION, seed=7, top_logprobs=3)
    choice = answer["choices"][0]
    ids, content = choice["token_ids"], choice["logprobs"]["content"]
    assert answer["object"] == "chat.completion" and choice["message"]["role"] == "assistant"
    assert answer["prompt_token_ids"] == render_prompt(CONVERSATION)
    assert len(ids) == len(content) == answer["usage"]["completion_tokens"]
    assert answer["usage"]["total_tokens"] == len(ids) + len(answer["prompt_token_ids"])
    assert choice["message"]["content"] == decode(ids)
    assert choice["finish_reason"] == ("stop" if ids[-1] == END else "length")
    assert (len(ids) == 12) or choice["finish_reason"] == "stop"
    assert headers["X-Policy-Version"] == answer["metadata"]["weight_version"] == "0"
    for token, entry in zip(ids, content, strict=True):
        assert len(entry["top_logprobs"]) == 3
        assert entry["top_logprobs"][0]["logprob"] >= entry["logprob"]
        if token >= 16:
            assert entry["bytes"] == [token - 16]
    # The engine's own ledger holds the same ids, under the episode's name.
    turn = server.ledger()["ep-1"][-1]
    assert (turn["prompt_ids"], turn["completion_ids"]) == (answer["prompt_token_ids"], ids)
    # Without the flags, neither ids nor log-probabilities.
    plain, _ = post(f"{server.url}/v1/chat/completions", {"messages": CONVERSATION})
    assert "prompt_token_ids" not in plain and "logprobs" not in plain["choices"][0]
    assert "token_ids" not in plain["choices"][0]
    assert plain["usage"]["completion_tokens"] <= engine.DEFAULT_MAX_TOKENS


@pytest.mark.parametrize("temperature", [1.0, 0.6, 0.0])
def test_sampled_logprobs_equal_a_teacher_forced_pass(server, temperature):
    """No drift: a fresh forward pass over prompt + completion gives the log-probabilities the
    tokens were sampled with (after temperature; greedy reports the raw distribution's)."""
    answer, _ = ask(server, CONVERSATION, seed=11, max_tokens=32, temperature=temperature)
    ids, prompt = ids_of(answer), answer["prompt_token_ids"]
    with torch.no_grad():
        logits = server.model(input_ids=torch.tensor([prompt + ids])).logits[0].float()
    scale = temperature if temperature > 0 else 1.0
    logp = torch.log_softmax(logits / scale, dim=-1)
    again = [float(logp[len(prompt) - 1 + n, token]) for n, token in enumerate(ids)]
    assert again == pytest.approx(logprobs_of(answer), abs=1e-4)


def test_a_finished_answer_carried_back_gives_an_append_only_prompt():
    """A model trained (in this process, the engine sharing it) to answer "ok": the answer
    ends with END, and carried back unchanged it is the next prompt's prefix."""
    model = engine.build_model(seed=0)
    with engine.EngineServer(model) as server:
        prompt = render_prompt(CONVERSATION)
        target = torch.tensor([[*prompt, *text_ids("ok"), END]])
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        with server.paused():  # no request samples from half-trained weights
            model.train()
            for _ in range(60):
                logits = model(input_ids=target[:, :-1]).logits[0, len(prompt) - 1 :]
                loss = torch.nn.functional.cross_entropy(logits, target[0, len(prompt) :])
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
            server.set_version(1)
        answer, headers = ask(server, CONVERSATION, temperature=0)
        assert headers["X-Policy-Version"] == "1"
        assert model.training  # the engine put the trainer's mode back
        choice = answer["choices"][0]
        assert (choice["message"]["content"], choice["finish_reason"]) == ("ok", "stop")
        assert ids_of(answer) == [*text_ids("ok"), END]
        follow = [*CONVERSATION, choice["message"], {"role": "user", "content": "again"}]
        second, _ = ask(server, follow, temperature=0)
        first = answer["prompt_token_ids"] + ids_of(answer)
        assert second["prompt_token_ids"][: len(first)] == first


def test_a_random_answer_is_append_only_exactly_when_its_bytes_are_text(server):
    """An answer whose ids are no UTF-8 text (or hold special ids) cannot come back as the
    same ids: the prefix then breaks, the drift re-tokenizing would cause on any engine."""
    for seed in range(60):
        answer, _ = ask(server, CONVERSATION, seed=seed, max_tokens=64)
        if answer["choices"][0]["finish_reason"] == "stop":
            break
    else:
        pytest.fail("no answer of 60 stopped at END")
    ids = ids_of(answer)
    assert ids[-1] == END
    message = answer["choices"][0]["message"]
    second, _ = ask(server, [*CONVERSATION, message, {"role": "user", "content": "again"}])
    first = answer["prompt_token_ids"] + ids
    round_trip = render_prompt([message])[2:-2] == ids
    assert (second["prompt_token_ids"][: len(first)] == first) is round_trip


def test_new_weights_bump_the_version_and_change_the_answers(tmp_path):
    with engine.EngineServer(engine.build_model(seed=0), version=4) as server:
        assert get(f"{server.url}/version")[0] == {"version": 4}
        before, headers = ask(server, CONVERSATION, temperature=0)
        assert headers["X-Policy-Version"] == "4"
        buffer = io.BytesIO()
        torch.save(engine.build_model(seed=1).state_dict(), buffer)
        done, headers = post(f"{server.url}/weights", buffer.getvalue(), {"Content-Type": "x/t"})
        assert done == {"version": 5} and headers["X-Policy-Version"] == "5"
        after, headers = ask(server, CONVERSATION, temperature=0)
        assert headers["X-Policy-Version"] == after["metadata"]["weight_version"] == "5"
        assert logprobs_of(after) != pytest.approx(logprobs_of(before), abs=1e-3)
        done, _ = post(
            f"{server.url}/weights",
            buffer.getvalue(),
            {"Content-Type": "x/t", "X-Policy-Version": "9"},
        )
        assert done == {"version": 9} and server.version == 9
        # A checkpoint file by path, with its version.
        path = tmp_path / "step.pt"
        torch.save(engine.build_model(seed=0).state_dict(), path)
        done, _ = post(f"{server.url}/weights", {"path": str(path), "version": 12})
        assert done == {"version": 12}
        assert logprobs_of(ask(server, CONVERSATION, temperature=0)[0]) == pytest.approx(
            logprobs_of(before), abs=1e-6
        )
        # In process: the next version, or the one given.
        assert server.update_weights(engine.build_model(seed=1).state_dict()) == 13
        assert server.update_weights(engine.build_model(seed=0).state_dict(), version=20) == 20
        assert get(f"{server.url}/version")[0] == {"version": 20}


@pytest.mark.parametrize(
    ("body", "headers", "why"),
    [
        (b"not a torch archive", {"Content-Type": "x/t"}, "could not be read"),
        (b"{", {}, "not JSON"),
        ({"version": 3}, {}, "names a checkpoint"),
        ({"path": "/nonexistent/step.pt"}, {}, "could not be read"),
        ({"path": "/x.pt", "version": "3"}, {}, "version must be an integer"),
        (b"", {"Content-Type": "x/t", "X-Policy-Version": "three"}, "X-Policy-Version"),
        ("small", {"Content-Type": "x/t"}, "do not fit the model"),
    ],
)
def test_bad_weights_get_a_400_and_change_nothing(server, body, headers, why):
    if body == "small":
        buffer = io.BytesIO()
        torch.save({"model.embed_tokens.weight": torch.zeros(3, 3)}, buffer)
        body = buffer.getvalue()
    version = server.version
    with pytest.raises(urllib.error.HTTPError) as refused:
        post(f"{server.url}/weights", body, headers)
    assert refused.value.code == 400
    assert why in json.load(refused.value)["error"]["message"]
    assert server.version == version


@pytest.mark.parametrize(
    ("body", "why"),
    [
        (b"not json", "not JSON"),
        ([], "JSON object"),
        ({"messages": "hi"}, "messages must be a list"),
        ({"messages": ["hi"]}, "messages must be a list of message objects"),
        ({"messages": [], "n": 2}, "n must be"),
        ({"messages": [], "max_tokens": 100000}, "max_tokens"),
        ({"messages": [], "max_tokens": 0}, "max_tokens"),
        ({"messages": [], "max_completion_tokens": 257}, "max_completion_tokens"),
        ({"messages": [], "temperature": -1}, "temperature"),
        ({"messages": [], "top_p": 0}, "top_p"),
        ({"messages": [], "seed": "x"}, "seed"),
        ({"messages": [], "logprobs": "yes"}, "logprobs"),
        ({"messages": [], "logprobs": True, "top_logprobs": 50}, "top_logprobs"),
        ({"messages": [], "stream": "yes"}, "stream"),
    ],
)
def test_bad_requests_get_a_400_with_the_reason(server, body, why):
    with pytest.raises(urllib.error.HTTPError) as refused:
        post(f"{server.url}/v1/chat/completions", body)
    assert refused.value.code == 400
    error = json.load(refused.value)["error"]
    assert why in error["message"] and error["type"] == "invalid_request_error"


def test_routes(server):
    models, _ = get(f"{server.url}/v1/models")
    assert models == {"object": "list", "data": [{"id": "tiny", "object": "model"}]}
    assert get(f"{server.url}/rollout/ep-9/v1/models")[0] == models
    assert get(f"{server.url}/health")[0] == {}
    for url in (f"{server.url}/v2/chat/completions", f"{server.url}/a/b/v1/chat/completions"):
        with pytest.raises(urllib.error.HTTPError) as missing:
            post(url, {"messages": []})
        assert missing.value.code == 404
    # Accepted and ignored: tools, tool_choice, nulls for defaults.
    body = {"messages": CONVERSATION, "tools": [{"type": "function"}], "tool_choice": "auto"}
    answer, _ = post(f"{server.url}/v1/chat/completions", body | {"max_tokens": None, "n": None})
    assert answer["choices"][0]["index"] == 0


def test_a_stream_assembles_into_the_same_answer(server):
    body = {"seed": 5, "max_tokens": 20, "stream_options": {"include_usage": True}}
    whole, _ = ask(server, CONVERSATION, **body)
    request = urllib.request.Request(
        f"{server.url}/v1/chat/completions",
        data=json.dumps(
            {"messages": CONVERSATION, "logprobs": True, "return_token_ids": True, "stream": True}
            | body
        ).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as answer:
        assert answer.headers["Content-Type"] == "text/event-stream"
        assert answer.headers["X-Policy-Version"] == whole["metadata"]["weight_version"]
        events = answer.read().decode().split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assembled = assemble_stream(chunks)
    for key in ("prompt_token_ids", "usage", "metadata"):
        assert assembled[key] == whole[key]
    choice, expected = assembled["choices"][0], whole["choices"][0]
    for key in ("token_ids", "logprobs", "finish_reason", "message"):
        assert choice[key] == expected[key]


def test_sampling_leaves_a_training_model_as_it_was_and_serializes_requests():
    model = engine.build_model(seed=2)
    model.train()
    with engine.EngineServer(model) as server:
        results: list = []

        def call(seed):
            results.append(ask(server, CONVERSATION, seed=seed)[0])

        threads = [threading.Thread(target=call, args=(s,)) for s in range(6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert len(results) == 6
        assert model.training and all(p.grad is None for p in model.parameters())
        assert len(server.ledger()["ep-1"]) == 6
    server.close()  # twice is harmless


def test_the_tokenizer_is_what_trls_grpo_trainer_needs():
    from transformers import PreTrainedTokenizerBase

    tokenizer = engine.build_tokenizer()
    assert isinstance(tokenizer, PreTrainedTokenizerBase)
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, END)
    assert len(tokenizer) == engine.VOCAB_SIZE
    assert sorted(tokenizer.all_special_ids) == list(range(16))
    # No response parser: TRL then hands its reward functions batch_decode's text.
    assert getattr(tokenizer, "response_template", None) is None
    assert getattr(tokenizer, "response_schema", None) is None
    for text in ["héllo wörld", " a  b\n\tc ", "日本 😀", "<s>x</s>"]:
        assert tokenizer(text, add_special_tokens=False)["input_ids"] == text_ids(text)
    rng = random.Random(0)
    batch = [
        [rng.randrange(engine.VOCAB_SIZE) for _ in range(rng.randrange(40))] for _ in range(300)
    ]
    batch.append([*text_ids("ab"), 16 + 0xC3, *text_ids("z"), 7, END])
    assert tokenizer.batch_decode(batch, skip_special_tokens=True) == [decode(i) for i in batch]


def test_one_grpo_step_with_the_engine_as_rollout_func(tmp_path):
    """TRL 1.16's GRPOTrainer takes the tokenizer as processing_class with a rollout_func that
    samples from the engine; its step trains the model the engine serves."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    model = engine.build_model(seed=0)
    server = engine.EngineServer(model)  # in process: complete() without HTTP
    contents: list[str] = []

    def rollout(prompts, trainer):
        out: dict = {"prompt_ids": [], "completion_ids": [], "logprobs": []}
        for seed, messages in enumerate(prompts):
            answer, _ = server.complete(
                {"messages": messages, "max_tokens": 8, "seed": seed, "logprobs": True}
                | {"return_token_ids": True}
            )
            out["prompt_ids"].append(answer["prompt_token_ids"])
            out["completion_ids"].append(ids_of(answer))
            out["logprobs"].append(logprobs_of(answer))
            contents.append(answer["choices"][0]["message"]["content"])
        return out

    seen: list[str] = []

    def reward(completions, **_):
        seen.extend(c[0]["content"] for c in completions)
        return [float(len(c[0]["content"])) for c in completions]

    before = {k: v.clone() for k, v in model.state_dict().items()}
    config = GRPOConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        num_generations=4,
        max_steps=1,
        max_completion_length=8,
        learning_rate=1e-2,
        beta=0.0,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
    )
    trainer = GRPOTrainer(
        model=model,
        processing_class=engine.build_tokenizer(),
        reward_funcs=[reward],
        args=config,
        train_dataset=Dataset.from_list([{"prompt": CONVERSATION}] * 4),
        rollout_func=rollout,
    )
    trainer.train()
    assert seen == contents and len(seen) == 4
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())
    server.close()
