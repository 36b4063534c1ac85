"""The rules of a batch request across its fields (`rollout_wire.request`'s table runs them
where the fields they read are known): what a backend, a warm pool and the tasks ask of each
other, and the batch's agent resolved into its tasks."""

from __future__ import annotations

from collections.abc import Mapping

from rollout_wire.field_table import ParseState
from rollout_wire.policy import PolicyEndpoint
from rollout_wire.task_spec import DEFAULT_TASK_TIME_LIMIT_SECONDS, ORACLE, oracle_problems
from rollout_wire.task_steps import kubernetes_step_problems


def on_pods(request: ParseState) -> bool:
    """A Pod per episode: Kubernetes' own rules apply (a host batch runs local semantics)."""
    return request["backend"] == "kubernetes" and request["isolation"] == "pod"


def host_only_on_kubernetes(request: ParseState) -> None:
    if request["isolation"] == "host" and request["backend"] != "kubernetes":
        request.problems.append(
            f"isolation: host is for backend kubernetes (sandbox-host Pods), not "
            f"{request['backend']!r}: the local backend's sandboxes already share its machine"
        )


def fresh_grade_in_the_batch_image(request: ParseState) -> None:
    """`grade: fresh` on Kubernetes for a task in its own image: its Pod seeds a workspace
    volume from the image's workdir and mounts it there in the agent's container and in a fresh
    grader's (kube pod_spec seeds_workspace), so the task names that workdir, and every task of
    its image grades `fresh` (one Job per image grades one way)."""
    if not on_pods(request):
        return
    by_image: dict[str, list] = {}
    for task in request["tasks"]:
        if task.get("image"):
            by_image.setdefault(task["image"], []).append(task)
    for image, tasks in by_image.items():
        fresh = [t.get("id") for t in tasks if t.get("grade") == "fresh"]
        if not fresh:
            continue
        same = [t.get("id") for t in tasks if t.get("grade") != "fresh"]
        if same:
            request.problems.append(
                f"grade: fresh on Kubernetes: the tasks of image {image!r} grade one way, but "
                f"{fresh[:3]} are fresh and {same[:3]} same"
            )
        no_workdir = [t.get("id") for t in tasks if not isinstance(t.get("workdir"), str)]
        if no_workdir:
            # The Pod mounts the handed-over workspace at the workdir, which must be known
            # before the image runs (locally it is the image's WORKDIR, read from its export).
            request.problems.append(
                f"grade: fresh on Kubernetes for a task in its own image needs its workdir "
                f"(Harbor [environment] workdir, the image's WORKDIR): {no_workdir[:3]} have none"
            )


def steps_where_they_run(request: ParseState) -> None:
    """Tasks with steps: on Kubernetes not in their own image (task_steps.kubernetes_step_problems),
    never from
    a warm pool (a warm sandbox is handed its task on a line the agent's sandbox holds, and has
    nowhere else to keep the later steps' tests)."""
    if on_pods(request):
        request.problems.extend(kubernetes_step_problems(request["tasks"]))
    if request.data.get("warm_pool") and any(t.get("steps") for t in request["tasks"]):
        request.problems.append("warm_pool cannot go with tasks with steps: they start cold")


def agent_env_only_local(request: ParseState) -> None:
    if request["agent_env"] is not None and on_pods(request):
        request.problems.append(
            "agent_env is for the local backend: on Kubernetes the image holds the agent"
        )


def warm_pool_without_workdir(request: ParseState) -> None:
    if request.data.get("warm_pool") and any(
        isinstance(t.get("workdir"), str) for t in request["tasks"]
    ):
        # A warm sandbox is started before its task is known: its workspace is /workspace.
        request.problems.append(
            "warm_pool cannot go with a task's workdir (a pool's sandboxes work in /workspace)"
        )


def policy_address_on_kubernetes(request: ParseState) -> None:
    policy = request["policy"]
    if request["backend"] == "kubernetes" and policy is not None and not policy.is_ip:
        request.problems.append(
            f"policy.url host {policy.host!r} must be an IP address on kubernetes: the batch's "
            "NetworkPolicy allows egress to that address only (it cannot match names)"
        )


def tasks_grouped_by_image(request: ParseState) -> None:
    tasks, image = request["tasks"], request["image"]
    if tasks and not request.problems:
        # One Job per image on Kubernetes: the tasks of an image are grouped (in the order the
        # images first appear, the tasks' own order kept within each image), so each image's
        # episodes are one range of indexes.
        first_seen = {t.get("image") or image: None for t in tasks}
        order = {name: position for position, name in enumerate(first_seen)}
        request.values["tasks"] = sorted(tasks, key=lambda t: order[t.get("image") or image])


def warm_pool_one_shape(request: ParseState) -> None:
    warm, tasks, image = request["warm_pool"], request["tasks"], request["image"]
    if warm and request["infra_retries"]:
        request.problems.append(
            "warm_pool cannot go with infra_retries: a warm episode has no retry"
        )
    if warm and len({t.get("image") or image for t in tasks}) > 1:
        request.problems.append("warm_pool needs one image for all tasks (a pool has one shape)")


def agent_into_tasks(request: ParseState) -> None:
    """The batch's agent runs every task that names none of its own."""
    agent = request["agent"]
    if agent is not None and not request.problems:
        tasks = [t if "agent" in t else t | {"agent": agent} for t in request["tasks"]]
        request.values["tasks"] = tasks
        if agent == ORACLE:
            # As before this check was written once: a batch oracle asks every task for its
            # solve.sh, even one that names an agent of its own (that task's is not run).
            request.problems.extend(oracle_problems([t | {"agent": ORACLE} for t in tasks]))


def tasks_have_a_policy(request: ParseState) -> None:
    tasks = request["tasks"]
    oracle_only = bool(tasks) and all(t.get("agent") == ORACLE for t in tasks)
    has_policy = isinstance(request.data.get("policy"), (Mapping, PolicyEndpoint))
    if tasks and not has_policy and not oracle_only:
        request.problems.append(
            "tasks need a policy to act (policy.url); only the demo has a fixed action"
        )


def task_limits_within_episode(request: ParseState) -> None:
    episode_timeout = request["episode_timeout_seconds"]
    for task in request["tasks"]:
        limit = task.get("time_limit_seconds", DEFAULT_TASK_TIME_LIMIT_SECONDS)
        if isinstance(limit, int) and limit >= episode_timeout:
            request.problems.append(
                f"task {task.get('id')!r}: time_limit_seconds {limit} must be below "
                f"episode_timeout_seconds ({episode_timeout}), which also covers setup and tests "
                "(rollout run: raise --episode-timeout, or lower the task's limit: Harbor's "
                "[agent] timeout_sec)"
            )
