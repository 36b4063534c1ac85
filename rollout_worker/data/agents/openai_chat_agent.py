"""A minimal coding agent on the official `openai` client: one `bash` tool, streamed answers.

The rollout runner starts it in the task's workspace with OPENAI_BASE_URL, OPENAI_API_KEY and
OPENAI_MODEL set to its recording proxy, and the task's statement in ROLLOUT_STATEMENT. It asks
the model, runs the commands the model calls `bash` with, shows it their output, and stops when
the model answers without a tool call, calls `submit`, or has had AGENT_MAX_STEPS turns
(default 10). What it prints ends up in the episode's `agent_output`.

A batch names it as its agent, with an interpreter that has `openai` installed:

    "agent": {"command": ["/opt/agent/bin/python", "/opt/agent/openai_chat_agent.py"],
              "env": {"AGENT_MAX_STEPS": "20"}}
"""

from __future__ import annotations

import json
import os
import subprocess
from typing import Any

# Not a dependency of the service: the agent's own environment has it.
import openai  # type: ignore[import-not-found,unused-ignore]

SYSTEM = (
    "You are a software engineer working in a repository (the current directory). Use the "
    "bash tool to look at files, change them and run commands. Call submit when you are done."
)
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "Run a shell command in the repository; shows exit code and output.",
            "parameters": {
                "type": "object",
                "properties": {"command": {"type": "string"}},
                "required": ["command"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "submit",
            "description": "Finish: the task is done.",
            "parameters": {"type": "object", "properties": {}},
        },
    },
]
COMMAND_TIMEOUT_SECONDS = 60
MAX_OUTPUT_CHARS = 8000  # of a command's output shown to the model (its end, where errors are)


def ask(client: openai.OpenAI, model: str, messages: list[Any]) -> tuple[str, list[dict]]:
    """One streamed completion, put together: (its text, its tool calls)."""
    text = ""
    calls: dict[int, dict] = {}
    stream = client.chat.completions.create(
        model=model, messages=messages, tools=TOOLS, stream=True
    )
    for chunk in stream:
        for choice in chunk.choices:
            text += choice.delta.content or ""
            # A tool call arrives in pieces: its id and name first, its arguments in parts.
            for part in choice.delta.tool_calls or []:
                call = calls.setdefault(part.index, {"id": "", "name": "", "arguments": ""})
                call["id"] = part.id or call["id"]
                if part.function is not None:
                    call["name"] += part.function.name or ""
                    call["arguments"] += part.function.arguments or ""
    return text, [calls[index] for index in sorted(calls)]


def bash(command: str) -> str:
    try:
        done = subprocess.run(
            command,
            shell=True,
            capture_output=True,
            text=True,
            timeout=COMMAND_TIMEOUT_SECONDS,
        )
    except subprocess.TimeoutExpired:
        return f"the command timed out after {COMMAND_TIMEOUT_SECONDS}s"
    output = done.stdout + done.stderr
    return f"exit code {done.returncode}\n{output[-MAX_OUTPUT_CHARS:]}"


def run_tool(call: dict) -> str:
    try:
        arguments = json.loads(call["arguments"] or "{}")
    except ValueError:
        return "error: the arguments are not JSON"
    command = arguments.get("command") if isinstance(arguments, dict) else None
    if call["name"] != "bash" or not isinstance(command, str):
        return "error: call bash with a string 'command', or submit"
    print(f"$ {command}", flush=True)
    return bash(command)


def main() -> int:
    client = openai.OpenAI()  # reads OPENAI_BASE_URL and OPENAI_API_KEY
    model = os.environ["OPENAI_MODEL"]
    messages: list[Any] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": os.environ["ROLLOUT_STATEMENT"]},
    ]
    for step in range(1, int(os.environ.get("AGENT_MAX_STEPS", "10")) + 1):
        text, calls = ask(client, model, messages)
        if not calls:
            print(f"step {step}: answered without a tool call: done", flush=True)
            return 0
        messages.append(
            {
                "role": "assistant",
                "content": text or None,
                "tool_calls": [
                    {
                        "id": call["id"],
                        "type": "function",
                        "function": {"name": call["name"], "arguments": call["arguments"]},
                    }
                    for call in calls
                ],
            }
        )
        for call in calls:
            if call["name"] == "submit":
                print(f"step {step}: submitted", flush=True)
                return 0
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": run_tool(call)})
    print("step limit reached", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
