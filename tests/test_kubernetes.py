"""launch/kubernetes.yaml: valid YAML, and a JobSet whose pods run `hybridshard launch` as the docs say;
launch/kubernetes/node-labels.yaml: the same, with the node's labels handed to the ranks."""

from __future__ import annotations

from pathlib import Path

import yaml

MANIFEST = Path(__file__).resolve().parents[1] / "launch" / "kubernetes.yaml"


def test_kubernetes_manifest_is_a_jobset_running_hybridshard_launch():
    (doc,) = list(yaml.safe_load_all(MANIFEST.read_text()))
    assert (doc["apiVersion"], doc["kind"]) == ("jobset.x-k8s.io/v1alpha2", "JobSet")
    (job,) = doc["spec"]["replicatedJobs"]
    spec = job["template"]["spec"]
    assert spec["completionMode"] == "Indexed" and spec["parallelism"] == spec["completions"]
    (container,) = spec["template"]["spec"]["containers"]
    env = {e["name"]: e for e in container["env"]}
    assert env["NNODES"]["value"] == str(spec["completions"])
    assert env["HYBRIDSHARD_NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    index = env["NODE_RANK"]["valueFrom"]["fieldRef"]["fieldPath"]
    assert index == "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    script = " ".join(container["args"])
    assert "python -m hybridshard launch" in script and '--node-rank "$NODE_RANK"' in script
    # The rendezvous is the first pod, by the name JobSet gives it: <jobset>-<job>-<job index>-<pod index>.<jobset>
    first = f"{doc['metadata']['name']}-{job['name']}-0-0.{doc['metadata']['name']}"
    assert f"--master-addr {first}" in script and doc["spec"]["network"]["enableDNSHostnames"] is True
    assert container["resources"]["limits"]["nvidia.com/gpu"] == int(env["NPROC_PER_NODE"]["value"])


NODE_LABELS = MANIFEST.parent / "kubernetes" / "node-labels.yaml"


def test_node_labels_manifest_hands_the_node_labels_to_the_ranks(tmp_path, monkeypatch):
    """launch/kubernetes/node-labels.yaml: a service account that may get nodes, an init container that
    writes the labels of spec.nodeName to an emptyDir, and a trainer whose HYBRIDSHARD_K8S_LABELS_FILE
    names that file; its script, run against a fake API server, writes what the probe reads."""
    import io
    import json
    import ssl
    import urllib.request

    from hybridshard.topology.netpath import NetworkPath, resolve_network_path

    docs = {d["kind"]: d for d in yaml.safe_load_all(NODE_LABELS.read_text())}
    account = docs["ServiceAccount"]["metadata"]["name"]
    (rule,) = docs["ClusterRole"]["rules"]
    assert rule["resources"] == ["nodes"] and "get" in rule["verbs"]
    binding = docs["ClusterRoleBinding"]
    assert binding["roleRef"]["name"] == docs["ClusterRole"]["metadata"]["name"]
    assert binding["subjects"][0]["name"] == account
    pod = docs["JobSet"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == account
    (init,), (trainer,) = pod["initContainers"], pod["containers"]
    assert {e["name"]: e for e in init["env"]}["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    shared = {m["name"]: m["mountPath"] for m in init["volumeMounts"]}
    (volume,) = [v for v in pod["volumes"] if v["name"] in shared]
    assert "emptyDir" in volume
    label_file = {e["name"]: e.get("value") for e in trainer["env"]}["HYBRIDSHARD_K8S_LABELS_FILE"]
    mount = {m["name"]: m["mountPath"] for m in trainer["volumeMounts"]}[volume["name"]]
    assert label_file.startswith(mount + "/") and shared[volume["name"]] == mount

    node = {"kind": "Node", "metadata": {"name": "gpu-7", "labels": {
        "topology.k8s.aws/network-node-layer-1": "nn-a", "topology.k8s.aws/network-node-layer-2": "nn-b"}}}
    asked = []

    def urlopen(request, context=None, timeout=None):
        asked.append((request.full_url, request.get_header("Authorization")))
        return io.BytesIO(json.dumps(node).encode())

    def fake_open(path, mode="r"):
        if path.endswith("/token"):
            return io.StringIO("secret-token\n")
        return open(tmp_path / Path(path).name, mode)

    monkeypatch.setattr(urllib.request, "urlopen", urlopen)
    monkeypatch.setattr(ssl, "create_default_context", lambda cafile=None: None)
    monkeypatch.setenv("NODE_NAME", "gpu-7")
    assert init["command"] == ["python", "-c"]
    exec(init["args"][0], {"open": fake_open, "__name__": "__main__"})
    assert asked == [("https://kubernetes.default.svc/api/v1/nodes/gpu-7", "Bearer secret-token")]
    written = tmp_path / Path(label_file).name
    got = resolve_network_path({"HYBRIDSHARD_K8S_LABELS_FILE": str(written)}, names=())
    assert got == NetworkPath(("nn-a", "nn-b"), "kubernetes labels (EKS)")
