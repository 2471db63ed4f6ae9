"""examples/kubernetes against the published CRD schemas, the operators' own rules and
what `mtcore train` reads, with no cluster (none ran them): see k8s_checks.problems for
what is checked. Each check is shown able to fail on a broken copy of a manifest."""

from __future__ import annotations

import copy
import re

import pytest
import yaml
from k8s_checks import pod_environment, problems, torchrun_launch, train_args, train_parser
from k8s_cluster import CRDS, EXAMPLES, SCHEMA_FILES, cluster_objects, manifests
from k8s_image import CONTAINERFILE, image

EXAMPLE_DIRS = ["pytorchjob", "jobset"]


@pytest.fixture(scope="module")
def built_image():
    return image(CONTAINERFILE.read_text())


@pytest.fixture(scope="module")
def examples():
    return {name: manifests(EXAMPLES / name) for name in EXAMPLE_DIRS}


def job_of(objects):
    return next(obj for obj in objects if obj["kind"] in ("PyTorchJob", "JobSet"))


def kind(objects, wanted):
    return next(obj for obj in objects if obj["kind"] == wanted)


def pod_spec(objects):
    job = job_of(objects)
    if job["kind"] == "PyTorchJob":
        return job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    return job["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]


def container(objects):
    return pod_spec(objects)["containers"][0]


def job_spec(objects):
    return job_of(objects)["spec"]["replicatedJobs"][0]["template"]["spec"]


def set_arg(objects, flag, value):
    args = container(objects)["args"]
    args[args.index(flag) + 1] = value


def set_config(objects, old, new):
    data = kind(objects, "ConfigMap")["data"]
    assert old in data["config.yaml"]
    data["config.yaml"] = data["config.yaml"].replace(old, new)


@pytest.mark.parametrize("name", EXAMPLE_DIRS)
def test_example_passes_every_check(examples, built_image, name):
    assert problems(examples[name], built_image) == []


def test_every_manifest_is_applied_by_a_kustomization():
    applied = {
        (obj["kind"], obj["metadata"]["name"])
        for d in EXAMPLE_DIRS
        for obj in manifests(EXAMPLES / d)
    }
    files = [p for p in EXAMPLES.rglob("*.yaml") if p.name != "kustomization.yaml"]
    on_disk = {
        (doc["kind"], doc["metadata"]["name"])
        for p in files
        for doc in yaml.safe_load_all(p.read_text())
    }
    assert on_disk == applied


def test_vendored_schemas_are_described():
    readme = (CRDS / "README.md").read_text()
    assert {p.name for p in CRDS.glob("*.json")} == set(SCHEMA_FILES.values())
    assert all(name in readme for name in SCHEMA_FILES.values())


def test_the_pods_get_the_environment_mtcore_train_reads(examples, built_image):
    # The operator's PET_* variables (pytorch/elastic.go) are what fills the PyTorchJob's
    # launch; the JobSet's come from its flags and the coordinator annotation.
    (pytorchjob, *_), _ = cluster_objects(job_of(examples["pytorchjob"]))
    assert pytorchjob.env["PET_NNODES"] == "2:4"
    assert pytorchjob.env["PET_RDZV_ENDPOINT"] == "mtcore-gpt-worker-0:29500"
    launch = torchrun_launch(train_args(pytorchjob, built_image)[1], pytorchjob.env)
    assert launch["rdzv_endpoint"] == "mtcore-gpt-worker-0:29500"
    assert (launch["nproc"], launch["max_restarts"], launch["rdzv_id"]) == ("8", 3, "mtcore-gpt")
    jobset_pods, services = cluster_objects(job_of(examples["jobset"]))
    assert [s.name for s in services] == ["mtcore-gpt"]
    assert [p.hostname for p in jobset_pods] == [f"mtcore-gpt-workers-0-{i}" for i in range(4)]
    launch = torchrun_launch(train_args(jobset_pods[3], built_image)[1], jobset_pods[3].env)
    fqdn = "mtcore-gpt-workers-0-0.mtcore-gpt.default.svc.cluster.local"
    assert launch["rdzv_endpoint"] == f"{fqdn}:29500"
    assert launch["nnodes"] == "2:4"


def test_mtcore_train_reads_the_same_launch(examples, built_image):
    """`mtcore train`'s own parser, once it takes issue 27's launch flags, must read the
    pods' command lines and PET_* variables as torchrun does (its ``launch``: the
    nodes, ranks per node, rendezvous and restarts it starts the agent with)."""
    if "--nnodes" not in train_parser().format_help():
        pytest.skip(
            "mtcore train has no --nnodes yet (issue 27's launch flags are not merged): "
            "the pods' launch was read with torch.distributed.run's parser only"
        )
    for name in EXAMPLE_DIRS:
        for pod in cluster_objects(job_of(examples[name]))[0]:
            args = train_args(pod, built_image)[1]
            expected = torchrun_launch(args, pod.env)
            with pod_environment(pod.env):
                launch = train_parser().parse_known_args(args)[0].launch
            assert f"{launch.min_nodes}:{launch.max_nodes}" == expected["nnodes"]
            assert str(launch.nproc) == expected["nproc"]
            assert launch.endpoint == expected["rdzv_endpoint"]
            assert launch.run_id == expected["rdzv_id"]
            assert launch.max_restarts == expected["max_restarts"]


def _misspell_command(objects):
    # the API server's strict field validation refuses a field the schema does not name
    container(objects)["comand"] = ["mtcore"]


BREAKS = {
    # name: (example, change, a line problems() must give)
    "unknown field": ("jobset", _misspell_command, r"Additional properties .*'comand'"),
    "wrong rendezvous host": (
        "jobset",
        lambda o: set_arg(o, "--rdzv-endpoint", "mtcore-gpt-worker-0-0.mtcore-gpt:29500"),
        r"rendezvous host mtcore-gpt-worker-0-0.mtcore-gpt resolves to 0 pods",
    ),
    "no headless service": (
        "jobset",
        lambda o: job_of(o)["spec"]["network"].update(enableDNSHostnames=False),
        r"resolves to 0 pods",
    ),
    "coordinator out of range": (
        "jobset",
        lambda o: job_of(o)["spec"]["coordinator"].update(podIndex=7),
        r"coordinator pod index 7 is invalid",
    ),
    "fewer pods than nnodes": (
        "jobset",
        lambda o: job_spec(o).update(parallelism=3, completions=3),
        r"nnodes 2:4: at most 4 nodes, but 3 pods run",
    ),
    "per-pod rendezvous id": (
        "jobset",
        lambda o: container(o)["env"][0]["valueFrom"]["fieldRef"].update(fieldPath="metadata.name"),
        r"rendezvous endpoints, ids or node counts differ",
    ),
    "kubelet restarts in place": (
        "jobset",
        lambda o: pod_spec(o).update(restartPolicy="OnFailure"),
        r"only restartPolicy Never is supported with podFailurePolicy",
    ),
    "143 not retried": (
        "jobset",
        lambda o: job_spec(o)["podFailurePolicy"]["rules"].pop(1),
        r"exit 143 \(preempted, saved\): the cluster would restart all, not retry",
    ),
    "pods started one after another": (
        "jobset",
        lambda o: job_spec(o).update(parallelism=2),
        r"workers: parallelism != completions: not every pod runs at once",
    ),
    "bad failure rule name": (
        "jobset",
        lambda o: job_of(o)["spec"]["failurePolicy"]["rules"][0].update(name="fail on 2"),
        r"failure policy rule name 'fail on 2' is invalid",
    ),
    "job name too long": (
        "jobset",
        lambda o: job_of(o)["metadata"].update(name="mtcore-" + "x" * 50),
        r"pod name mtcore-x+-workers-0-3-abcde is not a DNS-1035 label",
    ),
    "bad input restarts the jobset": (
        "jobset",
        lambda o: job_of(o)["spec"]["failurePolicy"].pop("rules"),
        r"exit 2 \(bad input\): the cluster would restart all, not fail",
    ),
    "eviction counted": (
        "jobset",
        lambda o: job_spec(o)["podFailurePolicy"]["rules"].pop(2),
        r"an evicted pod killed mid-save: the cluster would restart all, not retry",
    ),
    "mount of a missing volume": (
        "jobset",
        lambda o: container(o)["volumeMounts"].append({"name": "cache", "mountPath": "/cache"}),
        r"volumeMount cache: no such volume",
    ),
    "rendezvous port not served": (
        "jobset",
        lambda o: set_arg(o, "--rdzv-endpoint", "$(MTCORE_COORDINATOR):29400"),
        r"rendezvous port 29400 is not a port",
    ),
    "rendezvous endpoint without port": (
        "jobset",
        lambda o: set_arg(o, "--rdzv-endpoint", "$(MTCORE_COORDINATOR)"),
        r"rendezvous endpoint mtcore-gpt-workers-0-0.mtcore-gpt: no HOST:PORT",
    ),
    "rendezvous host only resolving to pod 0": (
        "jobset",
        lambda o: set_arg(o, "--rdzv-endpoint", "$(MTCORE_COORDINATOR):29500"),
        r"rendezvous host mtcore-gpt-workers-0-0.mtcore-gpt is not mtcore-gpt-workers-0-0's "
        r"hostname or FQDN",
    ),
    "undefined variable": (
        "jobset",
        lambda o: set_arg(o, "--rdzv-id", "$(JOB_ID)"),
        r"argument '\$\(JOB_ID\)': an undefined \$\(VAR\)",
    ),
    "operator's rendezvous host": (
        "pytorchjob",
        lambda o: job_of(o)["spec"]["elasticPolicy"].update(rdzvHost="mtcore-gpt-master-0"),
        r"rendezvous host mtcore-gpt-master-0 resolves to 0 pods",
    ),
    "etcd rendezvous": (
        "pytorchjob",
        lambda o: job_of(o)["spec"]["elasticPolicy"].update(rdzvBackend="etcd"),
        r"rendezvous backend etcd: mtcore train uses c10d",
    ),
    "no rendezvous id": (
        "pytorchjob",
        lambda o: job_of(o)["spec"]["elasticPolicy"].pop("rdzvId"),
        r"no rendezvous id",
    ),
    "no restarts": (
        "pytorchjob",
        lambda o: job_of(o)["spec"]["elasticPolicy"].update(maxRestarts=0),
        r"max restarts 0",
    ),
    "no resume": (
        "pytorchjob",
        lambda o: set_config(o, "resume: true", "resume: false"),
        r"checkpoint.resume false",
    ),
    "default shutdown timeout": (
        "pytorchjob",
        lambda o: container(o)["env"].pop(0),
        r"TORCH_ELASTIC_SHUTDOWN_TIMEOUT unset",
    ),
    "container not named pytorch": (
        "pytorchjob",
        lambda o: container(o).update(name="trainer"),
        r"must have at least one container with name pytorch",
    ),
    "nproc per node auto": (
        "pytorchjob",
        lambda o: job_of(o)["spec"].pop("nprocPerNode"),
        r"nproc per node 'auto': not a number of ranks",
    ),
    "more nodes than replicas": (
        "pytorchjob",
        lambda o: job_of(o)["spec"]["elasticPolicy"].update(maxReplicas=5),
        r"nnodes 2:5: at most 5 nodes, but 4 pods run",
    ),
    "preemption fails the job": (
        "pytorchjob",
        lambda o: job_of(o)["spec"]["pytorchReplicaSpecs"]["Worker"].update(restartPolicy="Never"),
        r"exit 143 \(preempted, saved\): the cluster would fail, not retry",
    ),
    "bad input retried forever": (
        "pytorchjob",
        lambda o: job_of(o)["spec"]["pytorchReplicaSpecs"]["Worker"].update(
            restartPolicy="OnFailure"
        ),
        r"exit 2 \(bad input\): the cluster would retry, not fail",
    ),
    "checkpoints off the shared volume": (
        "pytorchjob",
        lambda o: container(o)["volumeMounts"][1].update(mountPath="/data"),
        r"checkpoint.dir /mnt/shared/runs/gpt/checkpoints is not on a ReadWriteMany volume",
    ),
    "volume per node": (
        "pytorchjob",
        lambda o: kind(o, "PersistentVolumeClaim")["spec"].update(accessModes=["ReadWriteOnce"]),
        r"checkpoint.dir .* is not on a ReadWriteMany volume",
    ),
    "dp fixed": (
        "pytorchjob",
        lambda o: set_config(o, "pp: 1", "pp: 1\n  dp: 4"),
        r"parallel.dp is set",
    ),
    "batch not divisible on 3 pods": (
        "pytorchjob",
        lambda o: set_config(o, "global_batch_size: 96", "global_batch_size: 64"),
        r"config on 3 pods: global batch 64 is not divisible",
    ),
    "unknown config key": (
        "pytorchjob",
        lambda o: set_config(o, "keep_last: 3", "keep_last: 3\n  keep_first: 1"),
        r"config /etc/mtcore/config.yaml: .*keep_first",
    ),
    "config path not mounted": (
        "pytorchjob",
        lambda o: container(o).update(args=["mtcore", "train", "/etc/mtcore/job.yaml"]),
        r"no key job.yaml in ConfigMap mtcore-config",
    ),
    "no time to save": (
        "pytorchjob",
        lambda o: pod_spec(o).update(terminationGracePeriodSeconds=60),
        r"terminationGracePeriodSeconds 60 < the agent's 240 s wait",
    ),
    "entrypoint replaced": (
        "pytorchjob",
        lambda o: container(o).update(
            command=["mtcore"], args=["train", "/etc/mtcore/config.yaml"]
        ),
        r"replaces the image's ENTRYPOINT",
    ),
    "gpus and ranks disagree": (
        "pytorchjob",
        lambda o: container(o)["resources"]["limits"].update({"nvidia.com/gpu": 4}),
        r"8 ranks per pod, but the container asks for other nvidia.com/gpu",
    ),
    "image not the one built": (
        "pytorchjob",
        lambda o: container(o).update(image="mtcore:latest"),
        r"image mtcore:latest, built as registry.example.com/mtcore-cuda:0.1.0",
    ),
    "missing claim": (
        "pytorchjob",
        lambda o: kind(o, "PersistentVolumeClaim")["metadata"].update(name="other"),
        r"no PersistentVolumeClaim mtcore-shared",
    ),
}


@pytest.mark.parametrize("case", sorted(BREAKS))
def test_each_check_fails_on_a_broken_copy(examples, built_image, case):
    name, change, expected = BREAKS[case]
    broken = copy.deepcopy(examples[name])
    change(broken)
    found = problems(broken, built_image)
    assert any(re.search(expected, line) for line in found), found
