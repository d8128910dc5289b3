"""The install and user docs stay true to the code: every link resolves, the operations guide lists every
RBAC rule of the chart and exactly the metrics the code defines, the README keeps its two commands."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from chart_helpers import ROOT, doc_jaxjobs, operator_rules

DOCS = [ROOT / "README.md", ROOT / "docs" / "user-guide.md", ROOT / "docs" / "operations.md",
        ROOT / "docs" / "benchmarks.md", ROOT / "bench" / "results" / "CHANGELOG.md",
        *(ROOT / "docs" / page for page in ("uninstall.md", "faq.md", "comparison.md", "api-versioning.md")),
        ROOT / "CHANGELOG.md"]


def github_anchor(heading: str) -> str:
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    return {github_anchor(m.group(1)) for m in re.finditer(r"^#+ (.+)$", path.read_text(), flags=re.M)}


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_relative_links_resolve(doc: Path) -> None:
    text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+://", target):
            continue
        file_part, _, anchor = target.partition("#")
        linked = (doc.parent / file_part).resolve() if file_part else doc
        assert linked.exists(), f"{doc.name}: link to missing {target}"
        if anchor:
            assert anchor in anchors(linked), f"{doc.name}: no heading #{anchor} in {linked.name}"


def test_readme_keeps_its_two_commands() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert lines[:6] == [
        "# Resilax",
        "",
        "```bash",
        "scripts/demo   # the main job: a JAXJob on the local cluster survives a node loss and grows back",
        "scripts/test   # every test, as CI runs it",
        "```",
    ]


def test_operations_guide_explains_every_rbac_rule() -> None:
    text = (ROOT / "docs" / "operations.md").read_text()
    rbac = text[text.index("## RBAC"):text.index("## Metrics")]
    for rule in operator_rules():
        for resource in rule["resources"]:
            assert f"`{resource}" in rbac, f"docs/operations.md's RBAC table misses {resource}"
        for verb in rule["verbs"]:
            assert verb in rbac


def test_operations_guide_lists_exactly_the_sidecar_metrics() -> None:
    from resilax_sidecar.metrics import SidecarMetrics

    defined = {metric.name for metric in SidecarMetrics().registry.collect()}
    text = (ROOT / "docs" / "operations.md").read_text()
    section = text[text.index("### Sidecar"):text.index("### Operator")]
    documented = set(re.findall(r"^\| `(resilax_(?:sidecar_\w+|build_info))", section, flags=re.M))
    # prometheus_client reports counters without their `_total` suffix.
    assert {name.removesuffix("_total") for name in documented} == defined


@pytest.mark.parametrize("doc", [ROOT / "README.md", ROOT / "docs" / "user-guide.md"], ids=lambda p: p.name)
def test_documented_jaxjobs_are_valid(doc: Path) -> None:
    """The JAXJobs users copy from the docs pass the operator's own validation (the install test also
    has the API server accept them)."""
    from resilax_operator.validation import validate_spec

    jobs = doc_jaxjobs(doc)
    assert jobs, f"{doc.name} shows no JAXJob"
    for job in jobs:
        assert job["apiVersion"] == "resilax.dev/v1alpha1"
        validate_spec(job["spec"], name=job["metadata"]["name"])


def test_operations_guide_lists_exactly_the_operator_metrics() -> None:
    import prometheus_client
    import resilax_operator.metrics  # noqa: F401  (defines its metrics on the default registry)

    defined = {m.name for m in prometheus_client.REGISTRY.collect()
               if m.name.startswith("resilax_operator_") or m.name == "resilax_build_info"}
    text = (ROOT / "docs" / "operations.md").read_text()
    section = text[text.index("### Operator"):text.index("### Alerts and dashboard")]
    documented = set(re.findall(r"^\| `(resilax_(?:operator_\w+|build_info))", section, flags=re.M))
    assert {name.removesuffix("_total") for name in documented} == defined


def test_readme_first_screen_points_a_gke_user_to_the_quickstart() -> None:
    first_screen = "\n".join((ROOT / "README.md").read_text().splitlines()[:25])
    assert first_screen.startswith("# Resilax\n\n```bash\nscripts/demo")
    assert "docs/gke-quickstart.md" in first_screen and 'pip install "resilax[train]"' in first_screen
    quickstart = (ROOT / "docs" / "gke-quickstart.md").read_text()
    for step in ("gcloud container node-pools create", "--workload-pool", "gcloud storage buckets create",
                 "add-iam-policy-binding", "serviceAccountName", "docker push", "helm install", "kind: JAXJob",
                 "get jj -w"):
        assert step in quickstart, step


def test_benchmark_changelog_and_raw_results_match() -> None:
    """bench/results/CHANGELOG.md names every raw result file beside it, and only files that exist; every
    raw file docs/benchmarks.md quotes exists."""
    results = ROOT / "bench" / "results"
    raw = {p.name for p in results.glob("*.json")}
    changelog = (results / "CHANGELOG.md").read_text()
    named = set(re.findall(r"`([\w.-]+\.json)`", changelog))
    assert named == raw, (sorted(raw - named), sorted(named - raw))
    quoted = set(re.findall(r"bench/results/([\w.-]+\.json)", (ROOT / "docs" / "benchmarks.md").read_text()))
    assert quoted and quoted <= raw, sorted(quoted - raw)


def test_operations_guide_lists_every_condition_bucket_and_transition_kind() -> None:
    """docs/operations.md names the operator's conditions, goodput buckets and transition kinds as the
    code defines them (issue 41: it listed 5 conditions of 11, and missed `hang` and `TrainerHung`)."""
    from resilax_operator import api
    from resilax_operator import status as st
    from resilax_operator.status_fields import goodput as gp

    text = (ROOT / "docs" / "operations.md").read_text()
    conditions = text[text.index("The conditions are "):].split("; their reasons", 1)[0]
    assert set(re.findall(r"`(\w+)`", conditions)) == set(api.CONDITION_TYPES)
    buckets = text[text.index("`bucket`: "):].split(" (they sum", 1)[0]
    assert re.findall(r"`(\w+)`", buckets)[1:] == list(gp.BUCKETS)
    kinds = text[text.index("The `kind` label ranges over the transition kinds ("):].split(").", 1)[0]
    assert set(re.findall(r"`(\w+)`", kinds)) - {"kind"} == set(st.TRANSITION_KINDS)


def test_crd_applies_take_over_helms_fields() -> None:
    """A server-side apply of the CRDs over a helm-installed CRD conflicts on field ownership unless it
    forces: every documented one does (issue 41)."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "charts" / "resilax" / "README.md",
             ROOT / "charts" / "resilax" / "templates" / "NOTES.txt"]
    applies = [(page.name, line) for page in pages for line in page.read_text().splitlines()
               if "kubectl apply --server-side" in line]
    assert applies, "no documented CRD apply"
    assert [(name, line) for name, line in applies if "--force-conflicts" not in line] == []


def test_docs_name_our_jaxjob_unambiguously() -> None:
    """`kubectl get jaxjobs` may resolve to Kubeflow's JAXJob: the docs use `jj` or `jaxjobs.resilax.dev`."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
             ROOT / "charts" / "resilax" / "templates" / "NOTES.txt"]
    bare = re.compile(r"kubectl (?:[^`|\n]* )?jaxjobs?(?![.\w])")
    found = [f"{page.name}: {m.group(0)}" for page in pages for m in bare.finditer(page.read_text())]
    assert found == []


def test_uninstall_page_names_the_operators_finalizer_and_the_charts_crds() -> None:
    """docs/uninstall.md's finalizer and CRD names are the ones the operator sets and the chart installs
    (issue 41): a renamed finalizer or a new CRD would leave the documented uninstall incomplete."""
    import yaml
    from resilax_operator.handlers import FINALIZER

    text = (ROOT / "docs" / "uninstall.md").read_text()
    assert f"`{FINALIZER}`" in text
    assert """--type=merge -p '{"metadata":{"finalizers":null}}'""" in text
    crds = {doc["metadata"]["name"] for path in sorted((ROOT / "charts" / "resilax" / "crds").glob("*.yaml"))
            for doc in yaml.safe_load_all(path.read_text()) if doc}
    deleted = {name for line in text.splitlines() if line.startswith("kubectl delete crd ")
               for name in line.split("#")[0].split()[3:]}
    assert deleted == crds


def test_goodput_name_mapping_covers_every_bucket_once() -> None:
    """operations.md's table from our goodput buckets to ml-goodput-measurement's names has a row for
    every bucket of goodput.BUCKETS and no other (issue 41)."""
    from resilax_operator.status_fields import goodput as gp

    text = (ROOT / "docs" / "operations.md").read_text()
    table = text[text.index("| our bucket | ml-goodput-measurement |"):].split("\n\n", 1)[0]
    named = [name for row in table.splitlines()[2:] for name in re.findall(r"`(\w+)`", row.split("|")[1])]
    assert sorted(named) == sorted(gp.BUCKETS)
