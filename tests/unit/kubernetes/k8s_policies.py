"""What the admission webhooks and the Job API refuse, and what a cluster does when a
training container exits: the rules read from kubeflow/training-operator v1.9.0,
kubernetes-sigs/jobset v0.12.0 and kubernetes pkg/apis/batch/validation and
pkg/controller/job (the Job API's pod failure policy).

``admission_problems(job)`` lists what would be refused at ``kubectl apply``;
``outcome(job, exit_code, conditions)`` says what follows one pod's exit: "retry" (a
new pod for it, nothing else stops), "restart all" (every pod is recreated) or "fail".
"""

from __future__ import annotations

import re

DNS1035 = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
RULE_NAME = re.compile(r"[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?")  # jobset_webhook.go:418
JOB_FAILURE_REASONS = {  # jobset_webhook.go:85-91
    "BackoffLimitExceeded",
    "DeadlineExceeded",
    "FailedIndexes",
    "MaxFailedIndexesExceeded",
    "PodFailurePolicy",
}


def _dns1035(name: str) -> bool:
    return len(name) <= 63 and DNS1035.fullmatch(name) is not None


def _pytorchjob_admission(job: dict) -> list[str]:
    # webhooks/pytorch/pytorchjob_webhook.go: the name a DNS-1035 label (:80); an elastic
    # policy needs a Worker and not both nProcPerNode fields (:93-113); each replica has
    # containers with images, one named "pytorch" (:145), Worker replicas >= 1 (:157).
    problems = []
    name, spec = job["metadata"]["name"], job["spec"]
    if not _dns1035(name):
        problems.append(f"name {name!r} is not a DNS-1035 label")
    if "elasticPolicy" in spec:
        if "Worker" not in spec.get("pytorchReplicaSpecs", {}):
            problems.append("an elasticPolicy needs a Worker replica spec")
        if "nProcPerNode" in spec["elasticPolicy"] and "nprocPerNode" in spec:
            problems.append("elasticPolicy.nProcPerNode must not be used with nprocPerNode")
    for rtype, rspec in spec.get("pytorchReplicaSpecs", {}).items():
        containers = rspec["template"]["spec"].get("containers", [])
        if not any(c.get("name") == "pytorch" for c in containers):
            problems.append(f"{rtype} must have at least one container with name pytorch")
        problems += [
            f"{rtype} container {c['name']}: no image" for c in containers if not c.get("image")
        ]
        if rtype == "Worker" and rspec.get("replicas", 1) < 1:
            problems.append("Worker replicas must be at least 1")
    return problems


def _job_api(name: str, job_spec: dict) -> list[str]:
    """kubernetes pkg/apis/batch/validation: what the Job API refuses in a JobSet's child."""
    problems = []
    pod_spec = job_spec["template"]["spec"]
    restart = pod_spec.get("restartPolicy", "OnFailure")
    if restart not in ("OnFailure", "Never"):
        problems.append(f"{name}: restartPolicy {restart} (a Job takes OnFailure or Never)")
    if job_spec.get("completionMode") == "Indexed" and "completions" not in job_spec:
        problems.append(f"{name}: an Indexed Job needs completions")
    policy = job_spec.get("podFailurePolicy")
    if policy is None:
        return problems
    if restart != "Never":
        problems.append(f"{name}: only restartPolicy Never is supported with podFailurePolicy")
    if job_spec.get("podReplacementPolicy", "Failed") != "Failed":
        problems.append(f"{name}: podReplacementPolicy must be Failed with podFailurePolicy")
    names = {c["name"] for c in pod_spec.get("containers", []) + pod_spec.get("initContainers", [])}
    for index, rule in enumerate(policy.get("rules", [])):
        where = f"{name}: podFailurePolicy rule {index}"
        if rule.get("action") not in ("FailJob", "FailIndex", "Ignore", "Count"):
            problems.append(f"{where}: action {rule.get('action')!r}")
        if ("onExitCodes" in rule) == ("onPodConditions" in rule):
            problems.append(f"{where}: exactly one of onExitCodes and onPodConditions")
        codes = rule.get("onExitCodes")
        if codes is None:
            continue
        if codes.get("containerName") not in (None, *names):
            problems.append(f"{where}: containerName {codes['containerName']} is no container")
        if codes.get("operator") not in ("In", "NotIn"):
            problems.append(f"{where}: operator {codes.get('operator')!r}")
        values = codes.get("values", [])
        if not values or values != sorted(set(values)):
            problems.append(f"{where}: values must be non-empty, ordered, without duplicates")
        if codes.get("operator") == "In" and 0 in values:
            problems.append(f"{where}: value 0 cannot be used with In")
    return problems


def _jobset_admission(jobset: dict) -> list[str]:
    # webhooks/jobset_webhook.go ValidateCreate (:165-300): generated job and pod names are
    # DNS-1035 labels (:238-255); failure policy rules (:425-490); coordinator (:500-535).
    problems = []
    name, spec = jobset["metadata"]["name"], jobset["spec"]
    rjobs = {rjob["name"]: rjob for rjob in spec["replicatedJobs"]}
    for rjob in spec["replicatedJobs"]:
        job_spec = rjob["template"]["spec"]
        longest_job = f"{name}-{rjob['name']}-{rjob.get('replicas', 1) - 1}"
        if not _dns1035(longest_job):
            problems.append(f"job name {longest_job} is not a DNS-1035 label")
        completions = job_spec.get("completions")
        if job_spec.get("completionMode", "Indexed") == "Indexed" and completions:
            longest_pod = f"{longest_job}-{completions - 1}-abcde"
            if not _dns1035(longest_pod):
                problems.append(f"pod name {longest_pod} is not a DNS-1035 label")
        problems += _job_api(f"replicatedJob {rjob['name']}", job_spec)
    rules = spec.get("failurePolicy", {}).get("rules", [])
    names = [rule["name"] for rule in rules]
    for rule in rules:
        if not RULE_NAME.fullmatch(rule["name"]) or len(rule["name"]) > 128:
            problems.append(f"failure policy rule name {rule['name']!r} is invalid")
        problems += [
            f"failure policy rule {rule['name']}: unknown job failure reason {reason!r}"
            for reason in rule.get("onJobFailureReasons", [])
            if reason not in JOB_FAILURE_REASONS
        ]
        problems += [
            f"failure policy rule {rule['name']}: no replicatedJob {target}"
            for target in rule.get("targetReplicatedJobs", [])
            if target not in rjobs
        ]
    if len(set(names)) != len(names):
        problems.append("failure policy rule names are not unique")
    coordinator = spec.get("coordinator")
    if coordinator:
        rjob = rjobs.get(coordinator["replicatedJob"])
        if rjob is None:
            return [
                *problems,
                f"coordinator replicatedJob {coordinator['replicatedJob']} does not exist",
            ]
        job_spec = rjob["template"]["spec"]
        if not 0 <= coordinator.get("jobIndex", 0) < rjob.get("replicas", 1):
            problems.append(f"coordinator job index {coordinator.get('jobIndex', 0)} is invalid")
        completions = job_spec.get("completions")
        if job_spec.get("completionMode", "Indexed") != "Indexed" or completions is None:
            problems.append("job for coordinator pod must be Indexed with completions set")
        elif not 0 <= coordinator.get("podIndex", 0) < completions:
            problems.append(f"coordinator pod index {coordinator.get('podIndex', 0)} is invalid")
    return problems


def admission_problems(job: dict) -> list[str]:
    """What the operator's or JobSet's webhook (and the Job API) would refuse."""
    check = {"PyTorchJob": _pytorchjob_admission, "JobSet": _jobset_admission}[job["kind"]]
    return check(job)


def _pytorchjob_outcome(job: dict, exit_code: int, conditions: set[str]) -> str:
    # common/pod.go:341-367: the exit code of the container named "pytorch"; OnFailure and
    # Always retry, ExitCode retries 128-255 (util/train/train_util.go:24) and fails the
    # job on 1-127; Never fails it.
    policy = job["spec"]["pytorchReplicaSpecs"]["Worker"].get("restartPolicy", "OnFailure")
    if policy in ("OnFailure", "Always") or (policy == "ExitCode" and exit_code >= 128):
        return "retry"
    return "fail"


def _rule_matches(rule: dict, container: str, exit_code: int, conditions: set[str]) -> bool:
    # kubernetes pkg/controller/job/pod_failure_policy.go: the first rule whose exit codes
    # (of the named container) or pod conditions match decides.
    codes = rule.get("onExitCodes")
    if codes is not None:
        if codes.get("containerName", container) != container or exit_code == 0:
            return False
        inside = exit_code in codes.get("values", [])
        return inside if codes.get("operator") == "In" else not inside
    return any(
        pattern["type"] in conditions and pattern.get("status", "True") == "True"
        for pattern in rule.get("onPodConditions", [])
    )


def _jobset_outcome(jobset: dict, exit_code: int, conditions: set[str]) -> str:
    spec = jobset["spec"]
    rjob = spec["replicatedJobs"][0]
    job_spec = rjob["template"]["spec"]
    container = job_spec["template"]["spec"]["containers"][0]["name"]
    action = "Count"
    for rule in job_spec.get("podFailurePolicy", {}).get("rules", []):
        if _rule_matches(rule, container, exit_code, conditions):
            action = rule["action"]
            break
    if action == "Ignore":
        return "retry"  # a replacement pod, not counted towards backoffLimit
    if action == "FailJob":
        reason = "PodFailurePolicy"
    elif action == "Count" and job_spec.get("backoffLimit", 6) > 0:
        return "retry"  # one failure counted; the limit is not reached yet
    else:
        reason = "BackoffLimitExceeded" if action == "Count" else "FailedIndexes"
    # jobset controllers/failure_policy.go: no failurePolicy fails the JobSet (:45-60);
    # else the first rule matching the job's failure reason and replicatedJob (:87-175),
    # RestartJobSet when none does, until maxRestarts (:224-235).
    policy = spec.get("failurePolicy")
    if policy is None:
        return "fail"
    action = "RestartJobSet"
    for rule in policy.get("rules", []):
        reasons, targets = rule.get("onJobFailureReasons", []), rule.get("targetReplicatedJobs", [])
        if (not reasons or reason in reasons) and (not targets or rjob["name"] in targets):
            action = rule["action"]
            break
    if action == "RestartJobSetAndIgnoreMaxRestarts":
        return "restart all"
    if action == "RestartJobSet" and policy.get("maxRestarts", 0) > 0:
        return "restart all"
    return "fail"


def outcome(job: dict, exit_code: int, conditions: set[str] = frozenset()) -> str:
    """What follows when one pod's training container exits with ``exit_code`` while the
    pod has ``conditions`` (DisruptionTarget: evicted, preempted, its node drained)."""
    decide = {"PyTorchJob": _pytorchjob_outcome, "JobSet": _jobset_outcome}[job["kind"]]
    return decide(job, exit_code, set(conditions))
