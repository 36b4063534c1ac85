"""Redis as production runs it (AOF, a password, TLS), and Redis going away mid-batch."""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
import time

import pytest

from rollout_wire.errors import RedisUnavailable
from rollout_worker.cli.stack import LocalStack, free_port
from trainer_stub.client import RolloutClient

pytestmark = [pytest.mark.redis, pytest.mark.workers, pytest.mark.slow]


def test_workers_trainer_and_cli_use_a_password_and_tls():
    with LocalStack(collectors=1, tls=True, password="s3cret-pw") as stack:
        assert stack.redis_url.startswith("rediss://:s3cret-pw@")
        stack.wait_ready()
        client = RolloutClient(stack.redis_url)
        report = client.submit(count=4, parallelism=2).wait(120)
        assert (report["status"], report["reward_sum"]) == ("succeeded", 4)
        check = subprocess.run(
            [sys.executable, "-m", "rollout_worker.cli", "check", "--redis-url", stack.redis_url],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "KUBECONFIG": ""},
        )
        assert check.returncode == 0, check.stdout + check.stderr
        assert "queue collect: 1 worker(s)" in check.stdout
        # Without the password the server refuses: the password is really in force.
        plain = stack.redis_url.replace(":s3cret-pw@", "")
        with pytest.raises(Exception, match=r"(?i)auth"):
            RolloutClient(plain).redis.ping()
        client.close()


def _wait_for(path, pattern, proc, timeout):
    """The first match of `pattern` in the file `path` (a process's stderr), waiting for it."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        found = re.search(pattern, path.read_text())
        if found:
            return found
        assert proc.poll() is None, path.read_text()
        time.sleep(0.1)
    raise AssertionError(f"no {pattern!r} within {timeout}s in:\n{path.read_text()}")


def test_a_redis_restart_mid_batch_loses_nothing_and_every_client_rides_it_out(tmp_path):
    """Redis restarted (SIGTERM: it writes its AOF and exits; back 2 s later) while two
    batches run: the trainer API's (stream, then wait) and `rollout run --output`'s, whose
    receipt mirror, progress display and records writing all read Redis. Both wait it out:
    every episode reported, the records written, exit 0 (one restart for both: it costs the
    watchdog's rescue time)."""
    out, stderr, count = tmp_path / "rl-restart", tmp_path / "stderr.txt", 24
    with LocalStack(collectors=2, aof=True) as stack, stderr.open("w") as errors:
        stack.wait_ready()
        client = RolloutClient(stack.redis_url)
        batch = client.submit(count=40, parallelism=4)
        args = ["--count", str(count), "--parallelism", "1", "--output", str(out), "--json"]
        run = subprocess.Popen(
            [sys.executable, "-m", "rollout_worker.cli", "run", *args],
            stdout=subprocess.PIPE,
            stderr=errors,
            text=True,
            env={**stack.env, "ROLLOUT_REDIS_OUTAGE_SECONDS": "30"},
        )
        try:
            for seen, _row in enumerate(batch.stream(timeout=60), start=1):
                if seen == 8:
                    break
            # The CLI's batch is collecting too (its submit is done: the client is tested here).
            _wait_for(stderr, r" ok=[1-9]", run, 60)
            before = stderr.read_text()
            stack.restart_redis(down_seconds=2.0)
            report = batch.wait(300)
            output, _ = run.communicate(timeout=180)
        finally:
            if run.poll() is None:
                run.kill()
        client.close()
    assert (report["episodes"], report["collected_episodes"]) == (40, 40)
    assert (report["successful_episodes"], report["reward_sum"]) == (40, 40), report["errors"]
    assert sorted(row["index"] for row in report["pods"]) == list(range(40))
    # `rollout run --output`: mid-batch when Redis went away, then the report and the records.
    text = stderr.read_text()
    assert f" ok={count} " not in before, "the CLI's batch ended before Redis went away"
    assert run.returncode == 0, text
    assert "Traceback" not in text
    cli_report = json.loads(output)
    assert (cli_report["episodes"], cli_report["successful_episodes"]) == (count, count), text
    results = json.loads((out / "results.json").read_text())
    assert results["ok"] is True and len(results["pods"]) == count
    assert results["client_job_complete_seconds"] > 0
    assert results["client_submit_to_report_seconds"] > 0
    receipt = json.loads((out / "receipt.json").read_text())
    assert receipt["state"] == "reported" and receipt["run"]["run_uid"]


def test_redis_gone_for_good_ends_the_trainers_wait_with_a_clear_error():
    with LocalStack(collectors=1) as stack:
        stack.wait_ready()
        client = RolloutClient(stack.redis_url, outage_seconds=5)
        batch = client.submit(count=4, action="hang", deadline_seconds=600)
        stack.stop_redis()
        started = time.monotonic()
        with pytest.raises(RedisUnavailable, match="unreachable for 5s"):
            batch.wait(timeout=None)
        assert time.monotonic() - started < 30


def test_the_trainer_api_ends_a_send_to_an_unreachable_redis_with_a_clear_error():
    url = f"redis://:s3cret-pw@127.0.0.1:{free_port()}/0"  # nothing listens there
    client = RolloutClient(url, outage_seconds=1)
    started = time.monotonic()
    with pytest.raises(RedisUnavailable) as raised:
        client.submit(count=1)
    assert time.monotonic() - started < 10
    message = str(raised.value)
    assert "s3cret-pw" not in message and "\n" not in message
    assert message.startswith(f"Redis at {url.replace('s3cret-pw', '***')} unreachable for 1s")
    client.close()


def test_a_row_redis_lost_and_the_workers_recorded_again_is_given_to_the_trainer_once():
    """`everysec` can lose writes a reader already saw (Redis killed before they reached its
    file): the workers then record the lost row, and its group, again. One stream read (the
    trainer's) gives each once, the first time, and the report after them."""
    from rollout_wire import constants as k
    from rollout_wire.rows import EpisodeRow
    from rollout_wire.states import EpisodeStatus
    from rollout_worker.store import Store

    stack = LocalStack()  # a redis-server only: the writes are the workers' store's own
    stack.start_redis()
    client = RolloutClient(stack.redis_url)
    try:
        store, batch_id = Store.from_url(stack.redis_url, ttl=600), "lost-row"
        rows = [EpisodeRow(i, f"ep-{i}", EpisodeStatus.OK, reward=1) for i in range(2)]
        group = {"group_id": "g0", "samples": 2}
        for row in rows:
            store.record_episode(batch_id, row, log="")
        store.publish_group(batch_id, group, passes=True, wanted=0)
        read = client.entries([batch_id], timeout=30)
        first = [next(read)[1] for _ in range(3)]
        # The crash's loss: episode 1's row and the group, taken out as a restart from a file
        # without them would; then what the workers do about it.
        stream = k.stream_key(batch_id)
        for entry_id, _ in client.redis.xrange(stream)[1:]:
            client.redis.xdel(stream, entry_id)
        client.redis.hdel(k.episodes_key(batch_id), "1")
        client.redis.hdel(k.groups_key(batch_id), "g0")
        assert store.record_episode(batch_id, rows[1], log="")
        assert store.publish_group(batch_id, group, passes=True, wanted=0).published
        store.publish_report(batch_id, {"batch_id": batch_id, "status": "completed"})
        rest = [entry for _, entry in read]
    finally:
        client.close()
        stack.stop()
    assert [(e.type, e.index) for e in first] == [("episode", 0), ("episode", 1), ("group", None)]
    assert [e.type for e in rest] == ["report"], rest


# -- Redis killed (SIGKILL) mid-batch --------------------------------------------------------
#: The SIGKILL batch: enough episodes at once that rows are being written every moment around
#: the kill (200 take about a minute here on 2 cores; the kill comes after SIGKILL_AFTER_ROWS).
SIGKILL_EPISODES = 200
SIGKILL_PARALLELISM = 20
SIGKILL_AFTER_ROWS = 30
#: How long redis-server stays dead before it starts again from its files.
SIGKILL_DOWN_SECONDS = 2.0
#: Past the batch's deadline (240 s), the collection grace and the watchdog's margin: a batch
#: that lost an episode is reported (with that episode lost) before this.
SIGKILL_REPORT_TIMEOUT_S = 420.0


def sigkill_redis_mid_batch(
    stack: LocalStack, client: RolloutClient, batch_id: str
) -> tuple[dict, list[int]]:
    """Once SIGKILL_AFTER_ROWS rows of the batch have arrived, and while its report is not
    out, SIGKILL the stack's redis-server (an append-only file, fsynced every second), start it
    again from its files SIGKILL_DOWN_SECONDS later. Returns the batch's report and the indexes
    of the rows the trainer was given by one stream read through the kill."""
    from rollout_wire import constants as k

    rows = client.stream(batch_id, timeout=SIGKILL_REPORT_TIMEOUT_S)
    given = [row["index"] for row in itertools.islice(rows, SIGKILL_AFTER_ROWS)]
    assert len(given) == SIGKILL_AFTER_ROWS, f"the batch ended after {len(given)} rows"
    # Mid-batch: the report is not out (neither the report key nor its stream entry).
    assert client.report(batch_id) is None
    kinds = {e[b"type"] for _, e in client.redis.xrange(k.stream_key(batch_id))}
    assert k.ENTRY_REPORT.encode() not in kinds, kinds
    stack.kill_redis()
    killed_at = time.time()
    time.sleep(SIGKILL_DOWN_SECONDS)
    stack.start_redis()
    # `everysec` acknowledges writes before they reach the file (up to 2 s of them while a
    # slow fsync runs): rows the trainer saw can be gone. They are recorded again, and the
    # same stream read must not give them twice (every_episode_once_problems).
    kept = client.redis.hlen(k.episodes_key(batch_id))
    print(f"rows given before the kill: {len(given)}; in Redis after its restart: {kept}")
    given += [row["index"] for row in rows]
    report = client.report(batch_id)
    assert report is not None, "the stream ended without the report"
    # Built after the kill (its stamp is taken before it is published): the kill was mid-batch.
    assert report["reported_at"] > killed_at, (report["reported_at"], killed_at)
    return report, given


def every_episode_once_problems(
    client: RolloutClient, report: dict, count: int, given: list[int]
) -> list[str]:
    """What keeps `report` from holding each of `count` episodes exactly once, all succeeded
    (each named with its index and what the report says of it), and the trainer's stream read
    (`given`: its rows' indexes) from giving each once; empty when nothing does."""
    from collections import Counter

    from rollout_wire import codec
    from rollout_wire import constants as k

    problems = []
    totals = {n: report[n] for n in ("episodes", "collected_episodes", "successful_episodes")}
    if set(totals.values()) != {count}:
        problems.append(f"counts {totals}, expected {count} each; errors {report['errors']}")
    indexes = Counter(row["index"] for row in report["pods"])
    missing = sorted(set(range(count)) - set(indexes))
    if missing:
        problems.append(f"no row for episodes {missing}")
    twice = sorted(i for i, n in indexes.items() if n > 1)
    if twice:
        problems.append(f"episodes counted more than once: {twice}")
    for row in report["pods"]:
        if row["status"] != "ok":
            problems.append(f"episode {row['index']}: {row['status']}, errors {row['errors']}")
    raw = client.redis.xrange(k.stream_key(report["batch_id"]))
    entries = [codec.decode_entry(fields) for _, fields in raw]
    streamed = Counter(e.index for e in entries if e.type == k.ENTRY_EPISODE)
    if sorted(streamed.elements()) != list(range(count)):
        problems.append(
            f"the stream carried episodes {sorted(streamed.elements())} (not 0..{count - 1} once)"
        )
    if sorted(given) != list(range(count)):
        twice = sorted(i for i, n in Counter(given).items() if n > 1)
        never = sorted(set(range(count)) - set(given))
        problems.append(f"the trainer was given episodes {twice} twice and {never} never")
    return problems


def test_a_redis_sigkill_mid_batch_loses_no_episode_on_the_local_backend():
    """A crash of redis-server (SIGKILL: no final AOF write, no fsync, clients cut mid-reply)
    while rows are being written: started again from its append-only file, the batch still
    reports every episode exactly once, all succeeded."""
    env = {"ROLLOUT_MAX_BATCH_EPISODES": str(SIGKILL_EPISODES)}
    with LocalStack(collectors=2, aof=True, extra_env=env) as stack:
        stack.wait_ready()
        client = RolloutClient(stack.redis_url)
        try:
            batch = client.submit(count=SIGKILL_EPISODES, parallelism=SIGKILL_PARALLELISM)
            report, given = sigkill_redis_mid_batch(stack, client, batch.batch_id)
            problems = every_episode_once_problems(client, report, SIGKILL_EPISODES, given)
            if problems:
                stack.keep_dir = True  # the workers' and redis-server's logs, for the diagnosis
            assert not problems, f"logs in {stack.dir}:\n" + "\n".join(problems)
        finally:
            client.close()
