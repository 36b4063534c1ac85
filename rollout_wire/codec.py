"""How values are written to and read from Redis, for the workers' store and the trainer's
client alike: JSON values (orjson), receipts as hashes of JSON fields, and stream entries."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from rollout_wire import constants as k


def dumps(value: Any) -> bytes:
    return orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS)


def loads(raw: bytes | str) -> Any:
    return orjson.loads(raw)


def encode_fields(fields: Mapping[str, Any]) -> dict[str, bytes]:
    """A receipt's fields, each as its own JSON value, so updates never rewrite the whole."""
    return {name: dumps(value) for name, value in fields.items()}


def decode_fields(raw: Mapping[bytes, bytes]) -> dict[str, Any]:
    return {name.decode(): loads(value) for name, value in raw.items()}


def decode_text_hash(raw: Mapping[bytes, bytes]) -> dict[str, str]:
    """Logs and records: text stored as bytes (whatever a sandbox printed)."""
    return {name.decode(): value.decode("utf-8", "replace") for name, value in raw.items()}


@dataclass(frozen=True)
class Entry:
    """One entry of a batch's stream: an episode's progress state, its row, a group whose
    samples all have their row, or the report."""

    type: str
    index: int | None = None
    row: dict[str, Any] | None = None
    status: str | None = None  # the progress state, or the report's status
    # A group entry: the group's figures, with `counted` (it made the batch's quota) added.
    group: dict[str, Any] | None = None

    @property
    def once(self) -> tuple[str, Any] | None:
        """What a row or group entry is about (its episode, its group): each is meant once per
        batch, but a Redis crash can lose the last second of writes (`appendfsync everysec`)
        after a reader saw them, and the row lost is recorded, and streamed, again."""
        if self.type == k.ENTRY_EPISODE:
            return (self.type, self.index)
        if self.type == k.ENTRY_GROUP and self.group is not None:
            return (self.type, self.group.get("group_id"))
        return None


def state_entry(index: int, state: str) -> list[Any]:
    """Flat field list (the shape XADD takes, also inside Lua) of a progress entry."""
    return ["type", k.ENTRY_STATE, "index", index, "state", state]


def episode_entry(index: int, row_json: bytes) -> list[Any]:
    return ["type", k.ENTRY_EPISODE, "index", index, "row", row_json]


def group_entry(group_id: str, group_json: bytes) -> list[Any]:
    """Without `counted`: the store's script appends it (only the script knows it)."""
    return ["type", k.ENTRY_GROUP, "group_id", group_id, "group", group_json]


def report_entry(status: str) -> list[Any]:
    return ["type", k.ENTRY_REPORT, "status", status]


def decode_entry(data: Mapping[bytes, bytes]) -> Entry:
    kind = data[b"type"].decode()
    if kind == k.ENTRY_EPISODE:
        return Entry(kind, index=int(data[b"index"]), row=loads(data[b"row"]))
    if kind == k.ENTRY_GROUP:
        group = dict(loads(data[b"group"])) | {"counted": data.get(b"counted") == b"1"}
        return Entry(kind, group=group, status=str(group.get("status")))
    if kind == k.ENTRY_STATE:
        return Entry(kind, index=int(data[b"index"]), status=data[b"state"].decode())
    return Entry(kind, status=data.get(b"status", b"").decode())
