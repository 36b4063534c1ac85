"""The built-in agent loop: the policy's tools run in the workspace, turn by turn."""

from __future__ import annotations

import json
import os
import time

from .cost import LEDGER, check_time_limit, time_allowed
from .errors import InfrastructureError, ResponseTooLarge
from .events import MAX_OBSERVATION_BYTES, truncate
from .policy import Policy, policy_version, staleness
from .processes import run_command
from .steps import emit_step, turn_record
from .workspace import workspace_path

COMMAND_TIMEOUT_SECONDS = 30

SYSTEM_PROMPT = (
    "You are a software engineer working in a small Python repository. Use the tools to look "
    "at files, change them and run commands; call submit when the task is done. Every tool "
    "result is shown to you. Long outputs are truncated."
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "write_file",
            "description": "Create or replace a file of the repository with the given text.",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
                "required": ["path", "content"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Show a file of the repository.",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}},
                "required": ["path"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "run",
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
            "description": "Finish: the tests run and decide the reward.",
            "parameters": {"type": "object", "properties": {}},
        },
    },
]


class AgentLoop:
    """The built-in agent (a task without `agent`): ask the policy for actions, run them in the
    workspace, show it what they did, until submit or a limit. Runner's part; the fields below
    are the Runner's."""

    task: dict
    root: str
    env: dict
    agent_env: dict
    identity: dict
    policy: Policy | None
    max_steps: int
    time_limit: float
    # A task with steps runs the loop once per step: its step events go on numbering.
    step_offset = 0

    def need_policy(self) -> Policy:
        if self.policy is None:
            raise InfrastructureError("no policy for this episode (ROLLOUT_POLICY is not set)")
        return self.policy

    def prompt(self) -> list:
        """The same for every sample of the task: nothing episode-specific is shown."""
        files = sorted(set(self.task.get("files") or {}) | set(self.task.get("test_files") or {}))
        text = (
            f"{self.task['statement']}\n\nFiles: {', '.join(files)}\n"
            f"Tests: {' '.join(self.task['test_command'])}\n"
            f"You have {self.max_steps} turns. Call submit when done."
        )
        return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": text}]

    def execute(self, name: str, args: dict, deadline: float) -> tuple[str, bool]:
        """(observation, submitted)."""
        if name == "submit":
            return "submitted", True
        if name == "write_file":
            content = args.get("content")
            if not isinstance(content, str):
                return "error: write_file needs a string 'content'", False
            full = workspace_path(self.root, args.get("path"))
            os.makedirs(os.path.dirname(full), exist_ok=True)
            with open(full, "w") as handle:
                handle.write(content)
            return f"wrote {len(content.encode())} bytes to {args.get('path')}", False
        if name == "read_file":
            with open(workspace_path(self.root, args.get("path")), errors="replace") as handle:
                return handle.read(MAX_OBSERVATION_BYTES * 4), False
        if name == "run":
            command = args.get("command")
            if not isinstance(command, str):
                return "error: run needs a string 'command'", False
            timeout = min(COMMAND_TIMEOUT_SECONDS, deadline - time.time())
            code, output = run_command(command, timeout, self.agent_env)
            return f"exit code {code}\n{output}", False
        return f"error: unknown tool {name!r}; use write_file, read_file, run or submit", False

    @staticmethod
    def actions(message: dict) -> tuple[list, str | None]:
        """The turn's actions [(call id, name, arguments or an error)], or why there are none."""
        calls = message.get("tool_calls") or []
        if calls:
            found = []
            for call in calls:
                function = call.get("function") or {}
                try:
                    args = json.loads(function.get("arguments") or "{}")
                    if not isinstance(args, dict):
                        raise ValueError("arguments are not an object")
                except ValueError as exc:
                    args = {"__error__": f"arguments are not a JSON object: {exc}"}
                found.append((call.get("id"), str(function.get("name")), args))
            return found, None
        content = message.get("content")
        # A reply without tool calls may carry one action as a JSON object in its text.
        try:
            value = json.loads(content) if isinstance(content, str) else None
        except ValueError:
            value = None
        if isinstance(value, dict) and isinstance(value.get("tool"), str):
            args = value.get("arguments") if isinstance(value.get("arguments"), dict) else {}
            return [(None, value["tool"], args)], None
        return [], "malformed reply: no tool call and no JSON action"

    def loop(self) -> tuple[int, str]:
        """Ask, act, observe until submit or a limit: (steps, stop reason)."""
        messages = self.prompt()
        started = time.time()
        step = 0
        first_version: str | None = None
        sequence: list = []  # the last turn's prompt + completion ids
        while True:
            if step >= self.max_steps:
                return step, "max_steps"
            deadline = started + time_allowed(self.time_limit)
            if time.time() >= deadline:
                check_time_limit(self.time_limit)
                return step, "time_limit"
            step += 1
            asked = time.time()
            try:
                response, raw, attempts, header = self.need_policy().complete(messages, TOOLS)
            except InfrastructureError:
                LEDGER.turn(None, time.time() - asked)  # waited on, never answered
                raise
            except ResponseTooLarge:
                LEDGER.turn(None, time.time() - asked)
                return step - 1, "response_too_large"
            answered = time.time()
            LEDGER.turn(response, answered - asked)
            version = policy_version(header, response)
            if step == 1:
                first_version = version
            stale = staleness(first_version, version, self.need_policy().max_policy_lag, step - 1)
            if stale is not None:
                # This turn's actions come from a policy too far from the first turn's: none of
                # them runs, and the episode ends without tests (its steps so far are logged).
                raise stale
            message = response["choices"][0]["message"]
            messages.append(message)
            actions, problem = self.actions(message)
            records, submitted = self.take(actions, messages, deadline)
            if problem:
                messages.append(
                    {
                        "role": "user",
                        "content": "Your reply had no action. Call one of the tools "
                        "(write_file, read_file, run, submit).",
                    }
                )
            token_request = self.need_policy().token_request
            tokens, sequence, shown = turn_record(token_request, response, raw, sequence)
            fields = {
                "step": self.step_offset + step,
                "tokens": tokens,
                "actions": records,
                "error": problem,
                "policy_seconds": answered - asked,
                "policy_attempts": attempts,
                "policy_version": version,
                "action_seconds": time.time() - answered,
                "response": shown,
            }
            emit_step(fields, self.identity)
            if submitted:
                return step, "submit"

    def take(self, actions: list, messages: list, deadline: float) -> tuple[list, bool]:
        """Run a turn's actions, each observation added to `messages`: (the step's action
        records, whether one of them was submit)."""
        records = []
        submitted = False
        for call_id, name, args in actions:
            began = time.time()
            try:
                if "__error__" in args:
                    raise ValueError(args["__error__"])
                observation, done = self.execute(name, args, deadline)
            except (OSError, ValueError) as exc:
                observation, done = f"error: {exc}", False
            submitted = submitted or done
            shown, cut = truncate(observation)
            records.append(
                {
                    "tool": name,
                    "arguments": {k: v for k, v in args.items() if k != "__error__"},
                    "observation": shown,
                    "observation_bytes": len(observation.encode("utf-8", "replace")),
                    "truncated": cut,
                    "seconds": time.time() - began,
                }
            )
            if call_id is not None:
                messages.append({"role": "tool", "tool_call_id": call_id, "content": shown})
            else:
                messages.append({"role": "user", "content": f"Observation:\n{shown}"})
        return records, submitted
