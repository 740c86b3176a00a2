"""deploy/ is valid, offline: the Kubernetes manifests against the API's own schemas (kubernetes-validate's
bundled copies, strict: no field the API does not know), built through `kubectl kustomize` as users apply
them; the compose file against the Compose Specification's schema (tests/data/compose-spec.json, copied
from compose-spec/compose-spec at 170098b, Apache-2.0)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

DEPLOY = Path(__file__).parent.parent / "deploy"
KUBERNETES_VERSION = "1.31.0"  # the oldest with native sidecars on by default is 1.29; this is a current one


def _documents(text: str) -> list[dict[str, object]]:
    return [document for document in yaml.safe_load_all(text) if document]


def _validate(documents: list[dict[str, object]]) -> set[str]:
    for document in documents:
        kubernetes_validate.validate(document, KUBERNETES_VERSION, strict=True)
    return {str(document["kind"]) for document in documents}


def test_every_kubernetes_manifest_is_valid_for_the_api() -> None:
    kinds: set[str] = set()
    for path in sorted((DEPLOY / "kubernetes").rglob("*.yaml")):
        if path.name != "kustomization.yaml":
            kinds |= _validate(_documents(path.read_text()))
    assert kinds == {
        "Namespace", "Secret", "Deployment", "Service", "DaemonSet", "NetworkPolicy", "RuntimeClass",
    }  # fmt: skip


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed (Debian has no package of it)")
@pytest.mark.parametrize("overlay", ["base", "gvisor"])
def test_the_kustomizations_build_and_what_they_build_is_valid(overlay: str) -> None:
    built = subprocess.run(
        ["kubectl", "kustomize", str(DEPLOY / "kubernetes" / overlay)], capture_output=True, text=True, timeout=60
    )
    assert built.returncode == 0, built.stderr
    documents = _documents(built.stdout)
    kinds = _validate(documents)
    assert {"DaemonSet", "Deployment", "NetworkPolicy", "Namespace"} <= kinds
    assert ("RuntimeClass" in kinds) == (overlay == "gvisor")
    namespaced = [d for d in documents if d["kind"] not in ("Namespace", "RuntimeClass")]
    assert {d["metadata"]["namespace"] for d in namespaced} == {"metaagent"}  # type: ignore[index]


def test_the_compose_file_follows_the_compose_specification() -> None:
    schema = json.loads((Path(__file__).parent / "data" / "compose-spec.json").read_text())
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    jsonschema.Draft7Validator(schema).validate(compose)  # the draft its $schema names
    assert {"engine", "sandbox-build", "replica"} <= set(compose["services"])
    assert compose["services"]["engine"]["privileged"] is True
    assert "privileged" not in compose["services"]["replica"]
