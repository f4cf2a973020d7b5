"""launch/kubernetes.yaml: valid YAML, and a JobSet whose pods run `hybridshard launch` as the docs say."""

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
