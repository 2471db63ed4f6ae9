"""examples/kubernetes as a cluster would take it, with no cluster.

* ``manifests(directory)``: the objects ``kubectl apply -k DIRECTORY`` sends (kustomize's
  ``resources``: files, and directories with a kustomization.yaml of their own).
* ``schema_problems(obj)``: a custom resource against its vendored CRD schema
  (tests/data/crds), unknown fields refused as the API server's strict field validation
  (kubectl's default) refuses them.
* ``cluster_objects(job)``: the pods and headless Services that the Kubeflow training
  operator (v1.9.0) or the JobSet controller (v0.12.0) make of a job, with the names,
  labels and environment they add. Each step names the source it was read from:
  kubeflow/training-operator at v1.9.0 (6f74c7f6), kubernetes-sigs/jobset at v0.12.0
  (f22e565a), kubernetes/kubernetes pkg/controller/job.
* ``resolve(name, pods, services)``: the pods a DNS name leads to, from a pod.
* ``pod_argv(pod, image)``: the command line the kubelet starts, $(VAR) expanded.
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import jsonschema
import yaml

ROOT = Path(__file__).resolve().parents[3]
EXAMPLES = ROOT / "examples" / "kubernetes"
CRDS = ROOT / "tests" / "data" / "crds"
SCHEMA_FILES = {
    ("kubeflow.org/v1", "PyTorchJob"): "kubeflow.org_pytorchjobs.v1.schema.json",
    ("jobset.x-k8s.io/v1alpha2", "JobSet"): "jobset.x-k8s.io_jobsets.v1alpha2.schema.json",
}
NAMESPACE = "default"  # kubectl apply without -n
SEARCH = (
    f"{NAMESPACE}.svc.cluster.local",
    "svc.cluster.local",
    "cluster.local",
)  # a pod's resolv.conf
JOBSET_NAME = "jobset.sigs.k8s.io/jobset-name"
COORDINATOR = "jobset.sigs.k8s.io/coordinator"
COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"


class ManifestError(Exception):
    """A manifest the model cannot read at all (a missing file, an unmodelled shape)."""


@dataclass
class Pod:
    name: str
    hostname: str
    subdomain: str | None
    labels: dict[str, str]
    annotations: dict[str, str]
    spec: dict  # the pod spec after the controller's changes
    container: dict  # the training container
    env: dict[str, str] = field(default_factory=dict)  # its environment, resolved

    def own_names(self) -> set[str]:
        """The names the pod's /etc/hosts gives its own address (the kubelet writes
        <hostname>.<subdomain>.<namespace>.svc.<domain> first when there is a subdomain):
        the hostname and the FQDN torch's agent compares a rendezvous host with."""
        if self.subdomain is None:
            return {self.hostname}
        return {self.hostname, f"{self.hostname}.{self.subdomain}.{NAMESPACE}.svc.cluster.local"}


@dataclass
class Service:
    name: str
    selector: dict[str, str]

    def selects(self, pod: Pod) -> bool:
        return all(pod.labels.get(key) == value for key, value in self.selector.items())


@dataclass
class Image:
    """What the container build file says about the image: ENTRYPOINT, CMD, the tag it is
    built as and the working directory."""

    entrypoint: list[str]
    cmd: list[str]
    tag: str
    workdir: str


def manifests(directory: Path) -> list[dict]:
    """The objects of ``kubectl apply -k directory``, in kustomize's order."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unread = set(kustomization) - {"apiVersion", "kind", "resources"}
    if unread:
        raise ManifestError(f"{directory}: kustomization fields {sorted(unread)} are not modelled")
    objects: list[dict] = []
    for entry in kustomization["resources"]:
        path = directory / entry
        if path.is_dir():
            objects += manifests(path)
        elif path.is_file():
            objects += [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
        else:
            raise ManifestError(f"{directory / 'kustomization.yaml'}: {entry} does not exist")
    return objects


def _strict(schema: dict) -> dict:
    """``schema`` refusing fields it does not name, as the API server's strict field
    validation does (structural schemas only prune them; x-kubernetes-preserve-unknown-fields
    and additionalProperties keep them)."""
    out = {}
    for key, value in schema.items():
        if key == "properties":
            value = {name: _strict(sub) for name, sub in value.items()}
        elif key in ("items", "additionalProperties") and isinstance(value, dict):
            value = _strict(value)
        elif key in ("allOf", "anyOf", "oneOf"):
            value = [_strict(sub) for sub in value]
        out[key] = value
    keeps_unknown = "additionalProperties" in out or out.get("x-kubernetes-preserve-unknown-fields")
    if "properties" in out and not keeps_unknown:
        out["additionalProperties"] = False
    return out


@cache
def _validator(api_version: str, kind: str) -> jsonschema.Draft7Validator:
    schema = json.loads((CRDS / SCHEMA_FILES[api_version, kind]).read_text())
    return jsonschema.Draft7Validator(_strict(schema))


def schema_problems(obj: dict) -> list[str]:
    """Where a custom resource breaks its CRD's schema (none for core kinds: no schema)."""
    key = (obj.get("apiVersion"), obj.get("kind"))
    if key not in SCHEMA_FILES:
        return []
    errors = sorted(_validator(*key).iter_errors(obj), key=lambda e: list(e.absolute_path))
    return [f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in errors]


def _field(pod: Pod, path: str) -> str:
    """The downward API's value of ``path`` for ``pod`` ('' for an absent key)."""
    match = re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path)
    if match:
        return getattr(pod, match.group(1)).get(match.group(2), "")
    values = {"metadata.name": pod.name, "metadata.namespace": NAMESPACE}
    if path not in values:
        raise ManifestError(f"fieldRef {path} is not modelled")
    return values[path]


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion: a defined variable's value, $$ a literal $, and an
    undefined reference left as written."""

    def one(match: re.Match) -> str:
        if match.group(0) == "$$":
            return "$"
        return env.get(match.group(1), match.group(0))

    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)", one, text)


def _resolve_env(pod: Pod) -> None:
    # The kubelet: in order, each value expanded against those before it; a later
    # duplicate replaces an earlier one.
    env: dict[str, str] = {}
    for var in pod.container.get("env", []):
        if "valueFrom" in var:
            ref = var["valueFrom"].get("fieldRef")
            if ref is None:
                raise ManifestError(f"env {var['name']}: only fieldRef is modelled")
            env[var["name"]] = _field(pod, ref["fieldPath"])
        else:
            env[var["name"]] = expand(str(var.get("value", "")), env)
    pod.env = env


def pod_argv(pod: Pod, image: Image) -> list[str]:
    """The process the kubelet starts: command replaces the image's ENTRYPOINT (and its
    CMD), args replaces CMD; $(VAR) expanded against the container's environment."""
    command = pod.container.get("command")
    args = pod.container.get("args")
    if command is not None:
        argv = list(command) + list(args or [])
    else:
        argv = image.entrypoint + (list(args) if args is not None else image.cmd)
    return [expand(str(arg), pod.env) for arg in argv]


def _pytorchjob(job: dict) -> tuple[list[Pod], list[Service]]:
    name, spec = job["metadata"]["name"], job["spec"]
    replica_specs = spec["pytorchReplicaSpecs"]
    if set(replica_specs) != {"Worker"} or "elasticPolicy" not in spec:
        raise ManifestError("only an elastic, Worker-only PyTorchJob is modelled")
    replicas = replica_specs["Worker"].get("replicas", 1)  # setDefaultReplicas(spec, 1)
    elastic = spec["elasticPolicy"]
    # pytorch_defaults.go:38 setElasticPolicy: min and max default to each other, else
    # to the Worker replicas.
    least = elastic.get("minReplicas", elastic.get("maxReplicas", replicas))
    most = elastic.get("maxReplicas", elastic.get("minReplicas", replicas))
    # pytorch_defaults.go:68 setDefaultNprocPerNode: "auto" when neither is given.
    nproc = spec.get("nprocPerNode")
    if nproc is None and "nProcPerNode" not in elastic:
        nproc = "auto"
    pods, services = [], []
    for index in range(replicas):
        template = copy.deepcopy(replica_specs["Worker"]["template"])
        pod_spec = template["spec"]
        # pytorch_defaults.go:31 setPyTorchDefaultPort: port "pytorchjob-port" = 23456
        # on the container named "pytorch" (pytorch_types.go:25-29) when it has none.
        main = next((c for c in pod_spec["containers"] if c["name"] == "pytorch"), None)
        if main is None:
            raise ManifestError("no container named pytorch")
        ports = main.setdefault("ports", [])
        if not any(p.get("name") == "pytorchjob-port" for p in ports):
            ports.append({"name": "pytorchjob-port", "containerPort": 23456})
        port = next(p["containerPort"] for p in ports if p.get("name") == "pytorchjob-port")
        # common/pod.go:402-414: pod <job>-worker-<i> (common/util.go:50 GenGeneralName),
        # labelled job-name and operator-name (job_controller.go:236 GenLabels), replica
        # type and index; its hostname is its name (no spec.hostname).
        pod_name = f"{name}-worker-{index}"
        selector = {
            "training.kubeflow.org/operator-name": "pytorchjob-controller",
            "training.kubeflow.org/job-name": name,
            "training.kubeflow.org/replica-type": "worker",
            "training.kubeflow.org/replica-index": str(index),
        }
        labels = {**template.get("metadata", {}).get("labels", {}), **selector}
        # core/pod.go:81 SetRestartPolicy: ExitCode runs the pod as Never.
        policy = replica_specs["Worker"].get("restartPolicy", "OnFailure")
        pod_spec["restartPolicy"] = "Never" if policy == "ExitCode" else policy
        # pytorch/envvar.go:43-127 setPodEnv, appended to every container's env:
        # PYTHONUNBUFFERED (:58), PET_NPROC_PER_NODE (:101) and, for an elastic job,
        # elastic.go:68-122: PET_RDZV_ENDPOINT <job>-worker-0:<rdzvPort or the
        # pytorchjob-port> (:150, :155-163), PET_RDZV_BACKEND (default c10d, :195),
        # PET_NNODES min:max (:142), PET_MAX_RESTARTS, PET_RDZV_ID when set.
        injected = [("PYTHONUNBUFFERED", "1")]
        if nproc is not None:
            injected.append(("PET_NPROC_PER_NODE", str(nproc)))
        host = elastic.get("rdzvHost", f"{name}-worker-0")
        injected.append(("PET_RDZV_ENDPOINT", f"{host}:{elastic.get('rdzvPort', port)}"))
        injected.append(("PET_RDZV_BACKEND", elastic.get("rdzvBackend", "c10d")))
        injected.append(("PET_NNODES", f"{least}:{most}"))
        if "maxRestarts" in elastic:
            injected.append(("PET_MAX_RESTARTS", str(elastic["maxRestarts"])))
        if "nProcPerNode" in elastic:
            injected.append(("PET_NPROC_PER_NODE", str(elastic["nProcPerNode"])))
        if "rdzvId" in elastic:
            injected.append(("PET_RDZV_ID", elastic["rdzvId"]))
        for container in pod_spec["containers"]:
            container.setdefault("env", [])
            container["env"] += [{"name": key, "value": value} for key, value in injected]
        pod = Pod(pod_name, pod_name, None, labels, {}, pod_spec, main)
        _resolve_env(pod)
        pods.append(pod)
        # common/service.go:211-243 CreateNewService: one headless Service per replica,
        # named like its pod, selecting it.
        services.append(Service(pod_name, selector))
    return pods, services


def _jobset(jobset: dict) -> tuple[list[Pod], list[Service]]:
    name, spec = jobset["metadata"]["name"], jobset["spec"]
    # webhooks/jobset_webhook.go:111 Default: DNS hostnames on (:135); Indexed jobs
    # (:122); pod restartPolicy OnFailure when unset (:126).
    network = spec.get("network", {})
    dns = network.get("enableDNSHostnames", True)
    # jobset_controller.go:1090 GetSubdomain: network.subdomain, else the JobSet's name.
    subdomain = network.get("subdomain") or name
    coordinator = spec.get("coordinator")
    pods = []
    for rjob in spec["replicatedJobs"]:
        job_spec = rjob["template"]["spec"]
        indexed = job_spec.get("completionMode", "Indexed") == "Indexed"
        count = job_spec.get("completions", job_spec.get("parallelism", 1))
        for job_index in range(rjob.get("replicas", 1)):
            job_name = f"{name}-{rjob['name']}-{job_index}"  # placement.go:14 GenJobName
            for pod_index in range(count):
                template = copy.deepcopy(job_spec["template"])
                pod_spec = template["spec"]
                pod_spec.setdefault("restartPolicy", "OnFailure")
                # jobset_controller.go:1014 labelAndAnnotateObject: the same keys as labels
                # and annotations; the coordinator's endpoint (:1056, CoordinatorEndpoint
                # :1373) <jobset>-<rjob>-<job>-<pod>.<subdomain>.
                marks = {
                    JOBSET_NAME: name,
                    "jobset.sigs.k8s.io/replicatedjob-name": rjob["name"],
                    "jobset.sigs.k8s.io/job-index": str(job_index),
                }
                if coordinator:
                    marks[COORDINATOR] = (
                        f"{name}-{coordinator['replicatedJob']}-{coordinator.get('jobIndex', 0)}"
                        f"-{coordinator.get('podIndex', 0)}.{subdomain}"
                    )
                metadata = template.get("metadata", {})
                labels = {**metadata.get("labels", {}), **marks}
                annotations = {**metadata.get("annotations", {}), **marks}
                # kubernetes pkg/controller/job: an Indexed Job's pod gets the completion
                # index annotation and env JOB_COMPLETION_INDEX (indexed_job_utils.go
                # addCompletionIndexAnnotation, addCompletionIndexEnvVariable) and the
                # hostname <job>-<index> (job_controller.go manageJob).
                hostname = f"{job_name}-{pod_index}" if indexed else job_name
                if indexed:
                    annotations[COMPLETION_INDEX] = str(pod_index)
                    for container in pod_spec["containers"]:
                        env = container.setdefault("env", [])
                        if not any(var["name"] == "JOB_COMPLETION_INDEX" for var in env):
                            ref = f"metadata.annotations['{COMPLETION_INDEX}']"
                            env.append(
                                {
                                    "name": "JOB_COMPLETION_INDEX",
                                    "valueFrom": {"fieldRef": {"fieldPath": ref}},
                                }
                            )
                # jobset_controller.go:955: the pods' subdomain when DNS hostnames are on.
                pod_subdomain = subdomain if dns else None
                main = pod_spec["containers"][0]
                pod = Pod(
                    f"{job_name}-{pod_index}",
                    hostname,
                    pod_subdomain,
                    labels,
                    annotations,
                    pod_spec,
                    main,
                )
                _resolve_env(pod)
                pods.append(pod)
    # jobset_controller.go:788-830 createHeadlessSvcIfNecessary: with DNS hostnames on, one
    # headless Service named <subdomain> selecting the JobSet's pods by jobset-name.
    services = [Service(subdomain, {JOBSET_NAME: name})] if dns else []
    return pods, services


CONTROLLERS = {"PyTorchJob": _pytorchjob, "JobSet": _jobset}


def cluster_objects(job: dict) -> tuple[list[Pod], list[Service]]:
    """The pods and headless Services a PyTorchJob or a JobSet makes."""
    return CONTROLLERS[job["kind"]](job)


def resolve(name: str, pods: list[Pod], services: list[Service]) -> list[Pod]:
    """The pods that ``name`` leads to from a pod of the job's namespace: the search
    domains first (ndots 5), then the name as given. A headless Service's name leads to
    the pods it selects; <hostname>.<service> to the selected pod with that hostname and
    that subdomain (the Kubernetes DNS specification)."""
    by_name = {service.name: service for service in services}
    for candidate in [f"{name}.{domain}" for domain in SEARCH] + [name]:
        if not candidate.endswith(".svc.cluster.local"):
            continue
        labels = candidate.removesuffix(".svc.cluster.local").split(".")
        if labels[-1] != NAMESPACE or len(labels) not in (2, 3):
            continue
        service = by_name.get(labels[-2])
        if service is None:
            continue
        chosen = [pod for pod in pods if service.selects(pod)]
        if len(labels) == 3:
            chosen = [p for p in chosen if p.hostname == labels[0] and p.subdomain == service.name]
        if chosen:
            return chosen
    return []
