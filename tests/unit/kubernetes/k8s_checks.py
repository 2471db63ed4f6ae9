"""Whether the pods a Kubernetes example makes can run `mtcore train` as issue 27's launch
contract has it: ``problems(objects, image)`` lists, in one line each, what a cluster
would refuse or what would go wrong in the pods (an empty list: nothing found).

The launch each pod makes is read with torch.distributed.run's own parser (the torchrun
form the contract keeps equivalent: `mtcore train`'s --nproc is torchrun's
--nproc-per-node, the other launch flags share torchrun's names, the PET_* variables
fill what the command line leaves out) and mtcore's train parser for the config and
its overrides; the config with mtcore's own loader and layout check.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import tempfile
from pathlib import Path, PurePosixPath

from k8s_cluster import Image, Pod, cluster_objects, pod_argv, resolve, schema_problems
from k8s_policies import admission_problems, outcome

from mtcore.cli import train as train_cli

# `mtcore train` flag -> torchrun flag (the contract: --nproc N is --nproc-per-node N).
LAUNCH_FLAGS = {
    "--nproc": "--nproc-per-node",
    "--nnodes": "--nnodes",
    "--rdzv-endpoint": "--rdzv-endpoint",
    "--rdzv-id": "--rdzv-id",
    "--max-restarts": "--max-restarts",
}
GPU = "nvidia.com/gpu"
AGENT_SHUTDOWN_DEFAULT_S = 30  # torch/distributed/launcher/api.py: TORCH_ELASTIC_SHUTDOWN_TIMEOUT
AGENT_EXIT_MARGIN_S = 30  # the agent's own exit after the ranks' save


def train_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mtcore train")
    train_cli.add_arguments(parser)
    return parser


@contextlib.contextmanager
def pod_environment(env: dict[str, str]):
    """os.environ with the pod's PET_* variables in place of this process's."""
    saved = {key: value for key, value in os.environ.items() if key.startswith("PET_")}
    for key in saved:
        del os.environ[key]
    os.environ.update({key: value for key, value in env.items() if key.startswith("PET_")})
    try:
        yield
    finally:
        for key in [key for key in os.environ if key.startswith("PET_")]:
            del os.environ[key]
        os.environ.update(saved)


def torchrun_launch(args: list[str], env: dict[str, str]) -> dict:
    """The launch `mtcore train ARGS` makes under ``env``, read as its torchrun form."""
    from torch.distributed.run import get_args_parser

    flags, rest, index = [], [], 0
    while index < len(args):
        name, eq, value = args[index].partition("=")
        if name in LAUNCH_FLAGS:
            if not eq:
                index += 1
                value = args[index] if index < len(args) else ""
            flags += [LAUNCH_FLAGS[name], value]
        else:
            rest.append(args[index])
        index += 1
    if "PET_RDZV_BACKEND" not in env:
        flags += ["--rdzv-backend", "c10d"]  # mtcore train's rendezvous (the contract)
    with pod_environment(env):  # torch's parser reads PET_* as it is built
        torchrun = get_args_parser().parse_args([*flags, "-m", "mtcore.train", *rest])
    train = train_parser().parse_known_args(torchrun.training_script_args)[0]
    return {
        "nnodes": str(torchrun.nnodes),
        "nproc": str(torchrun.nproc_per_node),
        "rdzv_endpoint": torchrun.rdzv_endpoint,
        "rdzv_backend": torchrun.rdzv_backend,
        "rdzv_id": torchrun.rdzv_id,
        "max_restarts": int(torchrun.max_restarts),
        "config": train.config,
        "overrides": train.overrides,
    }


def train_args(pod: Pod, image: Image) -> tuple[list[str], list[str] | None]:
    """(problems, the arguments after `mtcore train`, None for another command) of the
    pod's command line."""
    argv = pod_argv(pod, image)
    out = [f"argument {arg!r}: an undefined $(VAR)" for arg in argv if "$(" in arg]
    if argv[: len(image.entrypoint)] == image.entrypoint:
        argv = argv[len(image.entrypoint) :]
    else:
        out.append(f"{argv[:2]} replaces the image's ENTRYPOINT {image.entrypoint} (PID 1)")
    if argv[:2] != ["mtcore", "train"]:
        return [*out, f"{argv[:2]}: not `mtcore train`"], None
    return out, argv[2:]


def _node_range(nnodes: str) -> tuple[int, int] | None:
    match = re.fullmatch(r"(\d+)(?::(\d+))?", nnodes)
    if match is None:
        return None
    return int(match.group(1)), int(match.group(2) or match.group(1))


def launch_problems(pods: list[Pod], services, image: Image) -> tuple[list[str], dict]:
    """Problems of the launches the pods make, and pod 0's launch."""
    out, launches = [], []
    for pod in pods:
        problems, args = train_args(pod, image)
        out += [f"pod {pod.name}: {p}" for p in problems]
        if args is None:
            return out, {}
        try:
            launches.append(torchrun_launch(args, pod.env))
        except SystemExit:
            return [*out, f"pod {pod.name}: `mtcore train {' '.join(args)}` does not parse"], {}
    launch = launches[0]
    if len({(item["rdzv_endpoint"], item["rdzv_id"], item["nnodes"]) for item in launches}) > 1:
        out.append("the pods' rendezvous endpoints, ids or node counts differ")
    if launch["rdzv_backend"] != "c10d":
        out.append(f"rendezvous backend {launch['rdzv_backend']}: mtcore train uses c10d")
    if not launch["rdzv_id"] or launch["rdzv_id"] == "none":
        out.append("no rendezvous id (the run id a restarted pod resumes with)")
    nodes = _node_range(launch["nnodes"])
    if nodes is None or not 1 <= nodes[0] <= nodes[1]:
        out.append(f"nnodes {launch['nnodes']}: not MIN:MAX")
    elif nodes[1] != len(pods):
        out.append(f"nnodes {launch['nnodes']}: at most {nodes[1]} nodes, but {len(pods)} pods run")
    if not launch["nproc"].isdigit():
        out.append(f"nproc per node {launch['nproc']!r}: not a number of ranks")
    elif str(pods[0].container.get("resources", {}).get("limits", {}).get(GPU)) != launch["nproc"]:
        out.append(f"{launch['nproc']} ranks per pod, but the container asks for other {GPU}")
    if launch["max_restarts"] < 1:
        out.append("max restarts 0: a rank's death ends the pod")
    host, _, port = launch["rdzv_endpoint"].rpartition(":")
    found = resolve(host, pods, services)
    if not port.isdigit():
        out.append(f"rendezvous endpoint {launch['rdzv_endpoint']}: no HOST:PORT")
    elif len(found) != 1:
        out.append(f"rendezvous host {host} resolves to {len(found)} pods of the job, not 1")
    elif int(port) not in [p["containerPort"] for p in found[0].container.get("ports", [])]:
        out.append(f"rendezvous port {port} is not a port of {found[0].name}'s container")
    elif host not in found[0].own_names():
        # torch/distributed/elastic/rendezvous/utils.py _matches_machine_hostname: the
        # agent hosts the c10d store when the endpoint is its hostname or FQDN (newer torch
        # also compares resolved addresses): else no agent may host it.
        out.append(f"rendezvous host {host} is not {found[0].name}'s hostname or FQDN")
    return out, launch


def _mount_of(pod: Pod, path: str) -> tuple[dict, dict] | None:
    """(volumeMount, volume) of the mount that holds ``path`` (the deepest one)."""
    volumes = {volume["name"]: volume for volume in pod.spec.get("volumes", [])}
    best = None
    for mount in pod.container.get("volumeMounts", []):
        holds = PurePosixPath(path).is_relative_to(mount["mountPath"]) and mount["name"] in volumes
        if holds and (best is None or len(mount["mountPath"]) > len(best[0]["mountPath"])):
            best = (mount, volumes[mount["name"]])
    return best


def volume_problems(pod: Pod, objects: list[dict]) -> list[str]:
    named = {(obj["kind"], obj["metadata"]["name"]) for obj in objects}
    volumes = {volume["name"] for volume in pod.spec.get("volumes", [])}
    out = [
        f"volumeMount {mount['name']}: no such volume"
        for mount in pod.container.get("volumeMounts", [])
        if mount["name"] not in volumes
    ]
    for volume in pod.spec.get("volumes", []):
        if "configMap" in volume and ("ConfigMap", volume["configMap"]["name"]) not in named:
            out.append(f"volume {volume['name']}: no ConfigMap {volume['configMap']['name']}")
        claim = volume.get("persistentVolumeClaim", {}).get("claimName")
        if claim and ("PersistentVolumeClaim", claim) not in named:
            out.append(f"volume {volume['name']}: no PersistentVolumeClaim {claim}")
    return out


def config_problems(pod: Pod, launch: dict, objects: list[dict], image: Image) -> list[str]:
    """The config the pods read, loaded and checked as `mtcore train` does."""
    from mtcore.training.config import ConfigError
    from mtcore.training.overrides import load_config

    if launch["config"] is None:
        return ["no CONFIG on the command line"]
    path = str(PurePosixPath(pod.container.get("workingDir", image.workdir), launch["config"]))
    held = _mount_of(pod, path)
    if held is None or "configMap" not in held[1]:
        return [f"config {path} is on no ConfigMap volume"]
    mount, volume = held
    maps = {obj["metadata"]["name"]: obj for obj in objects if obj["kind"] == "ConfigMap"}
    key = str(PurePosixPath(path).relative_to(mount["mountPath"]))
    data = maps.get(volume["configMap"]["name"], {}).get("data", {})
    if "items" in volume["configMap"] or key not in data:
        return [f"config {path}: no key {key} in ConfigMap {volume['configMap']['name']}"]
    with tempfile.TemporaryDirectory() as directory:
        copy = Path(directory) / key  # the same file name: the run's default name
        copy.write_text(data[key])
        try:
            config = load_config(copy, launch["overrides"])
        except ConfigError as error:
            return [f"config {path}: " + " ".join(str(error).replace(str(copy), path).split())]
    out = []
    if config.parallel.dp is not None:
        out.append("parallel.dp is set: an elastic job needs it unset (dp follows the nodes)")
    least, most = _node_range(launch["nnodes"]) or (1, 1)
    for nodes in range(least, most + 1):
        try:
            config.check(int(launch["nproc"]) * nodes)
        except (ValueError, ArithmeticError) as error:
            out.append(f"config on {nodes} pods: {error}")
    if not config.checkpoint.resume:
        out.append("checkpoint.resume false: a replacement pod would start from step 0")
    written = {
        "checkpoint.dir": config.checkpoint.dir,
        "logging.tensorboard_dir": config.logging.tensorboard_dir,
        "data.cache_dir": config.data.cache_dir,
    }
    claims = {
        obj["metadata"]["name"]: obj for obj in objects if obj["kind"] == "PersistentVolumeClaim"
    }
    for key, value in written.items():
        if value is None:
            continue
        where = str(PurePosixPath(pod.container.get("workingDir", image.workdir), str(value)))
        held = _mount_of(pod, where)
        claim = held[1].get("persistentVolumeClaim", {}).get("claimName") if held else None
        modes = claims.get(claim, {}).get("spec", {}).get("accessModes", [])
        if "ReadWriteMany" not in modes:
            out.append(f"{key} {where} is not on a ReadWriteMany volume every pod mounts")
    return out


def preemption_problems(job: dict, pod: Pod) -> list[str]:
    out = []
    shutdown = pod.env.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT")
    if shutdown is None:
        out.append("TORCH_ELASTIC_SHUTDOWN_TIMEOUT unset: the ranks get 30 s to save after SIGTERM")
    grace = pod.spec.get("terminationGracePeriodSeconds", 30)
    wait = int(shutdown or AGENT_SHUTDOWN_DEFAULT_S)
    if grace < wait + AGENT_EXIT_MARGIN_S:
        out.append(f"terminationGracePeriodSeconds {grace} < the agent's {wait} s wait + 30 s")
    expected = [
        (143, set(), {"retry"}, "exit 143 (preempted, saved)"),
        (143, {"DisruptionTarget"}, {"retry"}, "an evicted pod that saved"),
        (137, {"DisruptionTarget"}, {"retry"}, "an evicted pod killed mid-save"),
        (2, set(), {"fail"}, "exit 2 (bad input)"),
    ]
    for code, conditions, allowed, what in expected:
        result = outcome(job, code, conditions)
        if result not in allowed:
            out.append(f"{what}: the cluster would {result}, not {' or '.join(sorted(allowed))}")
    return out


def problems(objects: list[dict], image: Image) -> list[str]:
    """Everything found wrong in one example's objects, one line each."""
    out = []
    for obj in objects:
        out += [f"{obj['kind']} {p}" for p in schema_problems(obj)]
    (job,) = [obj for obj in objects if obj["kind"] in ("PyTorchJob", "JobSet")]
    refused = admission_problems(job)
    if refused:  # nothing runs
        return out + refused
    pods, services = cluster_objects(job)
    for pod in pods:
        out += volume_problems(pod, objects)
        if pod.container.get("image") != image.tag:
            out.append(f"pod {pod.name}: image {pod.container.get('image')}, built as {image.tag}")
    spec = job["spec"]
    for rjob in spec.get("replicatedJobs", []):
        job_spec = rjob["template"]["spec"]
        if job_spec.get("parallelism", 1) != job_spec.get("completions", 1):
            out.append(f"{rjob['name']}: parallelism != completions: not every pod runs at once")
    launch_found, launch = launch_problems(pods, services, image)
    out += launch_found
    if launch:
        out += config_problems(pods[0], launch, objects, image)
    return out + preemption_problems(job, pods[0])
